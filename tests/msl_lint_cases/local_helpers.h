// A local header the MSL7 case includes; quoted includes of our own headers are allowed.
#pragma once
#include <metal_stdlib>
