"""The reference pages against the code they describe, without the model: the server page's routes
against the app's OpenAPI schema, its flags against `tokendance serve`'s parser, its fields against
the request bodies, and the operations page's metrics against the server's definitions."""

from __future__ import annotations

import argparse
import re
import warnings
from types import SimpleNamespace

import pytest

from tests.docs.pages import DOCS, ROOT
from tokendance.server.app import create_app
from tokendance.server.cli import add_serve_arguments
from tokendance.server.config import ServerConfig
from tokendance.server.metrics import DEFINITIONS
from tokendance.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, RoundAgent, RoundRequest
from tokendance.server.responses import EXTENSIONS, IGNORED, UNSUPPORTED, ResponsesRequest

SERVER_PAGE = DOCS / "server.md"
ROUTE = re.compile(r"`(GET|HEAD|POST|PUT|PATCH|DELETE) (/[^`\s?]*)`")
# Routes the Ray Serve ingress answers itself (`tokendance serve --replicas`), outside the app.
INGRESS_ROUTES = {("GET", "/v1/replicas")}


def served_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, from its OpenAPI schema, plus the schema's
    own route. The app is built over a stand-in for the loaded model: building it reads only the
    engine's EOS ids (and the chat template, for tool_call_format "auto"), and no request is made."""
    engine = SimpleNamespace(model_config=SimpleNamespace(eos_token_ids=()))
    app = create_app(SimpleNamespace(engine=engine, tokenizer=None),
                     ServerConfig(model_name="m", tool_call_format="hermes"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FastAPI warns that GET and HEAD /health share an operation id
        schema = app.openapi()
    routes = {(method.upper(), path) for path, operations in schema["paths"].items() for method in operations}
    return routes | {("GET", app.openapi_url)}


def test_server_page_lists_every_route_the_app_serves_and_no_other():
    page = {(m.group(1), m.group(2)) for m in ROUTE.finditer(SERVER_PAGE.read_text())}
    served = served_routes()
    assert served - page == set(), "routes the app serves that server.md does not list"
    assert page - served - INGRESS_ROUTES == set(), "routes on server.md that the app does not serve"
    replicas = (ROOT / "tokendance" / "server" / "fleet" / "ingress.py").read_text()
    assert all(f'"{path}"' in replicas for _, path in INGRESS_ROUTES), "an ingress route server.md lists is gone"


def _serve_options() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


def test_server_page_flag_table_is_the_serve_parser():
    table = set(re.findall(r"^\| `(--[\w-]+)`", SERVER_PAGE.read_text(), re.MULTILINE))
    options = _serve_options()
    assert options - table == set(), "tokendance serve flags missing from server.md's table"
    assert table - options == set(), "flags in server.md's table that tokendance serve does not have"


def _code_words(text: str) -> set[str]:
    """Identifiers that appear inside inline code spans."""
    return {word for span in re.findall(r"`([^`\n]+)`", text) for word in re.findall(r"[A-Za-z_]\w*", span)}


@pytest.mark.parametrize("body", [ChatCompletionRequest, ChatMessage, CompletionRequest, RoundRequest, RoundAgent,
                                  ResponsesRequest], ids=lambda body: body.__name__)
def test_server_page_names_every_request_field(body):
    missing = set(body.model_fields) - _code_words(SERVER_PAGE.read_text())
    assert not missing, f"{body.__name__} fields server.md does not name: {sorted(missing)}"


def test_server_page_names_the_responses_api_extensions_and_refusals():
    missing = {*EXTENSIONS, *IGNORED, *UNSUPPORTED} - _code_words(SERVER_PAGE.read_text())
    assert not missing, f"Responses API fields server.md does not name: {sorted(missing)}"


def test_operations_page_lists_every_metric_and_no_other():
    text = (DOCS / "operations.md").read_text()
    listed = set(re.findall(r"^\| `(tokendance_\w+)`", text, re.MULTILINE))
    assert set(DEFINITIONS) - listed == set(), "metrics missing from operations.md"
    named = {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"\btokendance_\w+", text)}
    assert named - set(DEFINITIONS) == set(), "metrics on operations.md that the server does not define"
