"""The logits controls as JSON fields, the same on /v1/generate and OpenAI's completions and
chat: OpenAI's names (presence_penalty, frequency_penalty, logit_bias) and vLLM's
(repetition_penalty, min_p, min_tokens). Their formulas: engine.logits_controls."""

from __future__ import annotations

from pydantic import BaseModel, Field, StrictFloat, StrictInt

from ..errors import InvalidArgument

Number = StrictFloat | StrictInt


class SamplingControls(BaseModel):
    presence_penalty: Number | None = Field(None, description="-2..2: subtracted from a token's logit once it "
                                                              "was generated (OpenAI); default 0")
    frequency_penalty: Number | None = Field(None, description="-2..2: subtracted from a token's logit per time "
                                                               "it was generated (OpenAI); default 0")
    repetition_penalty: Number | None = Field(None, description="> 0: a logit of a token in the prompt or the "
                                                                "output is divided by it when positive, multiplied "
                                                                "when negative (CTRL, vLLM); default 1, none")
    logit_bias: dict[str, Number] | None = Field(None, description="Token id (a string, as OpenAI's JSON keys) -> "
                                                                   "bias added to its logit, -100..100")
    min_p: Number | None = Field(None, description="0..1: drop tokens less likely than min_p times the most "
                                                   "likely one, after the temperature (vLLM); default 0")
    min_tokens: StrictInt | None = Field(None, description="Hold back end-of-text and stop_token_ids until this "
                                                           "many tokens are out (vLLM); default 0")

    def controls(self) -> dict:
        """GenerateSettings' control fields (the service checks their ranges)."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise InvalidArgument(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        return dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logit_bias=bias, min_p=self.min_p,
                    min_tokens=self.min_tokens)
