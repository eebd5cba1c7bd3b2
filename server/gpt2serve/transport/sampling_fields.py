"""The logits controls and structured output as JSON fields, the same on /v1/generate and
OpenAI's completions and chat: OpenAI's names (presence_penalty, frequency_penalty, logit_bias,
response_format) and vLLM's (repetition_penalty, min_p, min_tokens, structured_outputs and the
older guided_json, guided_regex, guided_choice, guided_grammar). Their formulas:
engine.logits_controls; the grammars: engine.constraints."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..errors import InvalidArgument
from ..service.validation import one_constraint

ANY_OBJECT = '{"type": "object"}'  # json_object: a JSON schema that takes any object

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


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of these."""
    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json", description="A JSON schema")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = Field(None, description="Lark, or GBNF as llama.cpp writes it")
    json_object: StrictBool | None = Field(None, description="Any JSON object")


class StructuredOutputFields(BaseModel):
    response_format: dict[str, Any] | None = Field(
        None, description='OpenAI\'s: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", '
                          '"json_schema": {"name": ..., "schema": {...}}}')
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice, grammar "
                                                                           "or json_object, one of them")
    guided_json: dict[str, Any] | StrictStr | None = Field(None, description="vLLM's older name: a JSON schema")
    guided_regex: StrictStr | None = Field(None, description="vLLM's older name")
    guided_choice: list[StrictStr] | None = Field(None, description="vLLM's older name")
    guided_grammar: StrictStr | None = Field(None, description="vLLM's older name")

    def constraint(self) -> tuple[str, str, str] | None:
        """(kind, spec, field) for GenerateSettings.constraint, or None; more than one is a 400."""
        s = self.structured_outputs or StructuredOutputs()
        given = [("json_schema", s.json_, "structured_outputs.json"), ("regex", s.regex, "structured_outputs.regex"),
                 ("choice", s.choice, "structured_outputs.choice"),
                 ("grammar", s.grammar, "structured_outputs.grammar"),
                 ("json_schema", ANY_OBJECT if s.json_object else None, "structured_outputs.json_object"),
                 ("json_schema", self.guided_json, "guided_json"), ("regex", self.guided_regex, "guided_regex"),
                 ("choice", self.guided_choice, "guided_choice"), ("grammar", self.guided_grammar, "guided_grammar")]
        found = [self._response_format()] if self.response_format is not None else []
        found += [(kind, value if isinstance(value, str) else json.dumps(value), field)  # a schema or a list: JSON
                  for kind, value, field in given if value is not None]
        return one_constraint([c for c in found if c is not None])

    def _response_format(self) -> tuple[str, str, str] | None:
        kind = self.response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return "json_schema", ANY_OBJECT, "response_format"
        if kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise InvalidArgument("response_format: json_schema.schema must be a JSON schema object",
                                      param="response_format")
            return "json_schema", json.dumps(schema), "response_format"
        raise InvalidArgument(f"response_format: type {kind!r} is not one of text, json_object, json_schema",
                              param="response_format")

