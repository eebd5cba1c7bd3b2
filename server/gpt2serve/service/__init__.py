"""The service: what a valid request is, and how each kind of call runs over the engine client.

    inference.py           InferenceService: lifecycle and the entry points transports call
    validation.py          prompts, top-k, generate settings, trace policy
    next_token.py          a next-token call
    generation_stream.py   a generate call as a stream (detokenizer.py: its text)

Nothing here touches a transport or a process.
"""

from ..telemetry.records import RequestOptions
from .inference import InferenceService
from .validation import GenerateSettings, PromptInput

__all__ = ["GenerateSettings", "InferenceService", "PromptInput", "RequestOptions"]
