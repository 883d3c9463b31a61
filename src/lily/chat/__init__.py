"""From messages to tokens and back: the OpenAI chat-completions facade (`llm.chat`), the chat
template, tokenizer and detokenizer, tool calls, reasoning, stop strings, structured output.

Below it: `lily.engine` (it generates through an engine). Above it: `lily.api`, `lily.server`.
"""

from lily.chat.chat_template import ChatTemplate, TemplateLimits
from lily.chat.completions import Chat, ChatRequest, parse_request

__all__ = ["Chat", "ChatRequest", "ChatTemplate", "TemplateLimits", "parse_request"]
