"""What vLLM does not hand a KV connector: the model (its workers load it, connectors get none),
the layout of each layer's KV cache, and the tokens that end a line of a prompt.

The model is handed over by wrapping the model runners' `load_model` (installed by the general
plugin, `tokendance.vllm_plugin.register`): each loaded model is remembered in this process, the
one place a connector in the same worker can find it. No source of vLLM is changed.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import weakref

from tokendance.round_core.spans import Boundaries

logger = logging.getLogger("tokendance.vllm")

_models: list[weakref.ref] = []  # the models this process's runners loaded (one per worker)


def runner_classes() -> list[type]:
    """vLLM's model runners: the GPU one, the GPU one of Model Runner V2 (the default wherever
    Triton is installed), the CPU one, as far as this build has them."""
    from vllm.v1.worker import gpu_model_runner

    classes = [gpu_model_runner.GPUModelRunner]
    for module in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.cpu_model_runner"):
        try:
            imported = importlib.import_module(module)
        except Exception as exc:  # a build without it, or one whose import fails here (e.g. no GPU libraries)
            absent = isinstance(exc, ModuleNotFoundError) and exc.name == module  # not in this build: expected
            logger.log(logging.INFO if absent else logging.WARNING,
                       "TokenDanceConnector: cannot import %s (%s: %s): a model its runner loads is not handed over, "
                       "and passes on it fail (vLLM computes their requests exactly)", module, type(exc).__name__, exc)
            continue
        classes.append(imported.CPUModelRunner if module.endswith("cpu_model_runner") else imported.GPUModelRunner)
    return classes


def install() -> None:
    """Wrap every model runner's `load_model` so the loaded model is remembered."""
    classes = runner_classes()
    for cls in classes:
        original = cls.__dict__.get("load_model")
        if original is None or getattr(original, "_tokendance_handoff", False):
            continue

        @functools.wraps(original)
        def load_model(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            _models.append(weakref.ref(self.model))
            return result

        load_model._tokendance_handoff = True
        cls.load_model = load_model


def model():
    """The model this process's runner loaded (the latest, if several)."""
    for ref in reversed(_models):
        found = ref()
        if found is not None:
            return found
    raise RuntimeError("no model was handed over: is the `tokendance` vLLM plugin installed and allowed "
                       "(VLLM_PLUGINS must include it when set)?")


def layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else -1


def layouts(vllm_config, kv_caches: dict) -> list:
    """The layout of each decoder layer's KV cache, in layer order; UnsupportedModel if one has
    no reader here."""
    from tokendance.vllm_plugin.worker.layouts import find_layout
    from tokendance.vllm_plugin.worker.mirror_pass import UnsupportedModel

    context = vllm_config.compilation_config.static_forward_context
    block_size = vllm_config.cache_config.block_size
    found = []
    for name in sorted(kv_caches, key=layer_index):
        cache = kv_caches[name]
        cache = cache[0] if isinstance(cache, (list, tuple)) else cache
        layout = find_layout(context[name], cache, block_size)
        if layout is None:
            attention = context[name]
            raise UnsupportedModel(f"KV layout of {name} ({type(attention.impl).__name__}, "
                                   f"isa {getattr(attention, 'isa', None)}, {cache.dtype}) has no reader")
        found.append(layout)
    return found


@functools.lru_cache(maxsize=4)
def _boundaries(tokenizer_path: str, revision: str | None, trust_remote_code: bool) -> Boundaries:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, revision=revision, trust_remote_code=trust_remote_code)
    line_breaks = frozenset(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))
    return Boundaries(line_breaks, frozenset(tokenizer.all_special_ids))


def boundary_token_ids(model_config) -> Boundaries:
    """The token ids that cut a prompt into pieces (`round_core.spans.cut_spans`): those holding a
    line break, and the special tokens (message boundaries of chat templates)."""
    return _boundaries(model_config.tokenizer, getattr(model_config, "tokenizer_revision", None),
                       bool(model_config.trust_remote_code))
