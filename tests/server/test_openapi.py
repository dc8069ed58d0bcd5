"""The OpenAPI document: complete, self-consistent, exactly as strict as the Structs it is
generated from; and a property-based fuzz of the live server from it: no 5xx, every error in
the documented shape with a documented status, every 200 body valid against its schema, and
the server healthy and idle afterwards."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from mox.server.app import OPEN_PATHS, create_app
from mox.server.openapi import DOCUMENTED_TYPES, ERROR_STATUSES, openapi_document
from tests.server.conftest import API_KEY, DEMO_MODELS, wait_until

DOC = openapi_document()
SCHEMAS = DOC["components"]["schemas"]
ENDPOINTS = {"/v1/completions": "CompletionRequest",
             "/v1/chat/completions": "ChatCompletionRequest"}
STRUCTS = {t.__name__: t for t in DOCUMENTED_TYPES}
FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])
MAX_STRING, MAX_ITEMS = 24, 4   # short prompts and lists: the fuzz is about parsing, not prefill
MAX_FUZZ_TOKENS = 4             # a valid request decodes at most this many tokens

# Any JSON value, shallow (at most ~12 levels): nesting near msgspec's recursion limit (~1000
# levels) has its own test in test_protocol.py.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=MAX_STRING),
    lambda inner: st.lists(inner, max_size=MAX_ITEMS)
    | st.dictionaries(st.text(max_size=8), inner, max_size=MAX_ITEMS),
    max_leaves=12)


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    """Validates against `schema`, whose $refs point into this document's components."""
    return jsonschema.Draft202012Validator({**schema, "components": DOC["components"]})


def _ref_name(schema: dict) -> str:
    return schema["$ref"].rsplit("/", 1)[1]


def values(schema: dict, schemas: dict = SCHEMAS) -> st.SearchStrategy:
    """JSON values valid against `schema`. Everything but objects goes to hypothesis-jsonschema;
    objects are composed here because its object strategy calls `many.more()`, a Hypothesis
    internal that Hypothesis 6.170.10 removed. A Struct's object also gets unknown keys, which
    the schema allows and msgspec ignores."""
    if "$ref" in schema:
        return values(schemas[_ref_name(schema)], schemas)
    if "anyOf" in schema:
        return st.one_of([values(s, schemas) for s in schema["anyOf"]])
    if schema.get("type") == "object":
        props = {k: values(v, schemas) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        struct = st.fixed_dictionaries({k: props[k] for k in required},
                                       optional={k: s for k, s in props.items()
                                                 if k not in required})
        extra_values = values(schema["additionalProperties"], schemas) \
            if "additionalProperties" in schema else JSON
        extras = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in props),
                                 extra_values, max_size=2)
        return st.builds(lambda s, e: {**e, **s}, struct, extras)
    if schema.get("type") == "array" and _has_objects(schema["items"]):
        return st.lists(values(schema["items"], schemas), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", MAX_ITEMS))
    return from_schema(schema)


def _has_objects(schema: dict) -> bool:
    text = json.dumps(schema)
    return '"$ref"' in text or '"object"' in text


def _bounded(schema):
    """`schema` with every string and list kept short."""
    if isinstance(schema, list):
        return [_bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {k: _bounded(v) for k, v in schema.items()}
    if bounded.get("type") == "string" and "enum" not in bounded:
        bounded["maxLength"] = MAX_STRING
    if bounded.get("type") == "array":
        bounded["maxItems"] = MAX_ITEMS
    return bounded


CHEAP_TOKENS = {"type": "integer", "minimum": -1, "maximum": MAX_FUZZ_TOKENS}
VALID_TOKENS = {"type": "integer", "minimum": 1, "maximum": MAX_FUZZ_TOKENS}
DEMO_OR_ANY = {"anyOf": [{"enum": list(DEMO_MODELS)}, {"type": "string"}]}
# Parameters the server refuses (unsupported by mox), in all or most of their values: left
# out of the `likely_valid` bodies so that most of those reach the engine.
REFUSED = ("n", "presence_penalty", "frequency_penalty", "logit_bias", "echo", "best_of",
           "suffix", "top_logprobs", "tools", "tool_choice", "response_format", "logprobs",
           "stream_options", "repetition_penalty", "min_p", "min_tokens", "use_beam_search",
           "include_stop_str_in_output", "prompt_logprobs", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "truncate_prompt_tokens", "skip_special_tokens",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
           "documents")
IN_RANGE = {"temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 64},
            "seed": {"type": "integer", "minimum": 0, "maximum": 2**32},
            "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                          "maximum": 255}},
            "model": {"enum": list(DEMO_MODELS)},
            "max_tokens": VALID_TOKENS,
            "max_completion_tokens": {"anyOf": [VALID_TOKENS, {"type": "null"}]},
            "messages": {"type": "array", "minItems": 1,
                         "items": {"$ref": "#/components/schemas/ChatMessage"}},
            "stop": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
            "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "minItems": 1,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 255}}]}}


def fuzz_schemas(likely_valid: bool) -> dict:
    """The components, bounded so a request is cheap: short strings and lists, and (required,
    as chat's default limit is thousands of tokens) `max_tokens` <= MAX_FUZZ_TOKENS.
    `likely_valid`: also in range and without the parameters the server refuses."""
    schemas = _bounded(copy.deepcopy(SCHEMAS))
    for name in ENDPOINTS.values():
        struct = schemas[name]
        struct["properties"].update(max_tokens=CHEAP_TOKENS, model=DEMO_OR_ANY)
        struct["required"].append("max_tokens")
        if "max_completion_tokens" in struct["properties"]:
            struct["properties"]["max_completion_tokens"] = {"anyOf": [CHEAP_TOKENS,
                                                                       {"type": "null"}]}
        if likely_valid:
            struct["properties"].update(_bounded({k: v for k, v in IN_RANGE.items()
                                                  if k in struct["properties"]}))
            for refused in REFUSED:
                struct["properties"].pop(refused, None)
    if likely_valid:
        schemas["ChatMessage"]["properties"]["role"] = {"enum": ["system", "user", "assistant"]}
        schemas["ChatMessage"]["properties"].pop("tool_calls")           # refused
        schemas["TextPart"] = {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"enum": ["text"]}, "text": {"type": "string", "maxLength": MAX_STRING}}}
    return schemas


LOOSE, LIKELY_VALID = fuzz_schemas(likely_valid=False), fuzz_schemas(likely_valid=True)


def _encode(body) -> bytes:
    return json.dumps(body).encode()


def request_bodies(name: str, kind: str) -> st.SearchStrategy[bytes]:
    """Bodies for the request Struct `name`: valid by its schema (`loose`, `likely_valid`), one
    field of a likely-valid body replaced by any JSON (`wrong_type`), any JSON at all, or
    bytes that are not JSON (random, or a valid body cut short)."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    valid = values(ref, LIKELY_VALID)
    if kind == "wrong_type":
        fields = sorted(SCHEMAS[name]["properties"])
        return st.builds(lambda b, k, v: {**b, k: v}, valid, st.sampled_from(fields),
                         JSON).filter(_is_cheap).map(_encode)
    if kind == "any_json":
        return JSON.map(_encode)
    if kind == "not_json":
        cut = st.builds(lambda b, f: _encode(b)[:max(1, int(len(_encode(b)) * f))], valid,
                        st.floats(0, 0.99))
        return st.binary(max_size=64) | cut
    return values(ref, LOOSE if kind == "loose" else LIKELY_VALID).map(_encode)


def _is_cheap(body: dict) -> bool:
    """Whether `body` cannot ask for more than MAX_FUZZ_TOKENS tokens. Excluded: a token limit
    replaced by null or a larger int, which asks for up to the server's default or cap
    (thousands of tokens): slow on a CPU, not wrong."""
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    return not (limit is None or (type(limit) is int and limit > MAX_FUZZ_TOKENS))


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"data: [DONE]\n\n"), raw
    return [e.removeprefix(b"data: ") for e in raw[:-2].split(b"\n\n")][:-1]


def check_exchange(path: str, method: str, status: int, headers: dict, raw: bytes) -> None:
    """The fuzz's invariants for one request and its answer."""
    responses = DOC["paths"][path][method.lower()]["responses"]
    assert status < 500, raw
    assert str(status) in responses, f"undocumented status {status}: {raw[:300]!r}"
    content_type = headers["Content-Type"].split(";")[0]
    if status >= 400:
        assert content_type == "application/json"
        error = json.loads(raw)
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param",
                                                                   "code"}, error
        _validator({"$ref": "#/components/schemas/ErrorBody"}).validate(error)
        return
    media = responses["200"]["content"][content_type]
    if content_type == "text/event-stream":
        for event in _events(raw):
            data = json.loads(event)
            assert "error" not in data, data         # a failure mid-stream is a server fault
            _validator(media["x-event-data"]).validate(data)
            msgspec.json.decode(event, type=STRUCTS[_ref_name(media["x-event-data"]["oneOf"][0])])
    elif content_type == "application/json":
        _validator(media["schema"]).validate(json.loads(raw))
        if "$ref" in media["schema"]:
            msgspec.json.decode(raw, type=STRUCTS[_ref_name(media["schema"])])
    else:
        _validator(media["schema"]).validate(raw.decode())


# --- the document ----------------------------------------------------------------------------

def test_every_ref_resolves_and_every_struct_is_described():
    refs = set(re.findall(r'"\$ref": "([^"]*)"', json.dumps(DOC)))
    assert len(refs) > len(ERROR_STATUSES)
    for ref in refs:
        assert ref.startswith("#/"), ref
        node = DOC
        for part in ref[2:].split("/"):
            node = node[part]                       # KeyError: a dangling $ref
    assert {t.__name__ for t in DOCUMENTED_TYPES} <= set(SCHEMAS)
    assert {f"#/components/responses/Error{s}" for s in ERROR_STATUSES} <= refs


def test_document_matches_the_routes_and_open_paths(fake_backend):
    app = create_app(fake_backend, api_key=API_KEY)
    routes = {(r.resource.canonical, r.method.lower()) for r in app.router.routes()
              if r.method != "HEAD"}                  # aiohttp adds HEAD to every GET
    documented = {(p, m) for p, ops in DOC["paths"].items() for m in ops}
    assert documented == routes
    open_ops = {p for p, ops in DOC["paths"].items() for op in ops.values()
                if op.get("security") == []}
    assert open_ops == OPEN_PATHS
    assert DOC["openapi"].startswith("3.1") and DOC["info"]["version"]


@pytest.mark.parametrize("name", sorted(ENDPOINTS.values()))
def test_request_schema_is_exactly_as_strict_as_the_struct(name):
    """For bodies near the schema's edge (one field of a valid body replaced by any JSON):
    the schema accepts exactly what msgspec decodes."""
    validator = _validator({"$ref": f"#/components/schemas/{name}"})

    @FUZZ
    @given(request_bodies(name, "wrong_type"))
    def check(raw):
        body = json.loads(raw)
        # JSON Schema's "integer" includes 2.0, msgspec's int does not: not a divergence
        assume(not any(isinstance(v, float) and v.is_integer() for v in _leaves(body)))
        try:
            msgspec.json.decode(raw, type=STRUCTS[name])
            decodes = True
        except msgspec.ValidationError:
            decodes = False
        assert validator.is_valid(body) == decodes, body

    check()


def _leaves(node):
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list):
        for value in node:
            yield from _leaves(value)
    else:
        yield node


def test_served_document_is_open_and_the_rest_is_not(fake):
    status, headers, raw = fake.request("GET", "/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(raw) == json.loads(json.dumps(DOC))
    status, headers, raw = fake.request("POST", "/v1/completions", b"{}")
    check_exchange("/v1/completions", "POST", status, headers, raw)
    assert status == 401


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/openapi.json"])
def test_get_routes_answer_as_documented(live, path):
    status, headers, raw = live.request("GET", path)
    assert status == 200
    check_exchange(path, "GET", status, headers, raw)


# --- the fuzz --------------------------------------------------------------------------------

def _idle(backend) -> bool:
    models = backend.snapshot()["models"].values()
    return all(m.get("running", 0) == 0 and m.get("waiting", 0) == 0 for m in models)


@pytest.mark.parametrize("kind", ["loose", "likely_valid", "wrong_type", "any_json", "not_json"])
@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_fuzz_live_server(live, router_backend, path, kind):
    statuses = []

    @FUZZ
    @given(request_bodies(ENDPOINTS[path], kind))
    def exchange(raw):
        status, headers, body = live.request("POST", path, raw)
        statuses.append(status)
        check_exchange(path, "POST", status, headers, body)

    exchange()
    if kind == "likely_valid":      # else the fuzz would only ever test the validation
        assert statuses.count(200) >= len(statuses) // 2, statuses
    assert live.request("GET", "/health")[:1] == (200,)
    assert wait_until(lambda: _idle(router_backend)), router_backend.snapshot()
