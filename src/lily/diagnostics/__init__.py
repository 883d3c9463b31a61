"""What this machine can run: `lily doctor` (every kernel against its float64 reference, on
the devices at hand) and the arithmetic of the Metal memory preflight."""
