"""Constrained decoding, measured in one run on the default model:

1. per-step overhead: decode tokens/s of batches of 1 and 16 free requests against the same
   batches constrained by a JSON schema (every request generates exactly --tokens tokens: the
   free ones ignore EOS, the schema cannot complete sooner), and the compile time of a schema;
2. valid answers: one generative-agents round whose instruction asks for a JSON answer, answered
   free and with `response_format` (the schema below): the share of answers that parse and
   validate.

    .venv/bin/python benchmarks/structured.py [--tokens 48] [--agents 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokendance import LLM, SamplingParams  # noqa: E402
from tokendance.structured import StructuredOutput  # noqa: E402
from tokendance.workloads import make_workload  # noqa: E402

LONG = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                     "minItems": 1000}}, "required": ["numbers"]}
ACTION = {"type": "object", "properties": {
    "say": {"type": "string", "maxLength": 200},
    "action": {"enum": ["talk", "walk", "work", "rest", "eat", "shop"]},
    "target": {"type": "string", "maxLength": 40}},
    "required": ["say", "action", "target"], "additionalProperties": False}
JSON_INSTRUCTION = (' Reply only with a JSON object {"say": what you say, "action": one of talk, walk, work, rest, '
                    'eat, shop, "target": a person or place}.')


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == set(ACTION["properties"]) and isinstance(value["say"], str)
            and value["action"] in ACTION["properties"]["action"]["enum"] and isinstance(value["target"], str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per request in part 1")
    parser.add_argument("--agents", type=int, default=16, help="agents of the round in part 2")
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    llm = LLM(kv_cache_bytes=2**29)
    engine = llm.engine
    print(f"dtype {engine.dtype}, CPU {engine.cpu.describe()}")
    started = time.perf_counter()
    engine.grammars.matcher(StructuredOutput(json=LONG))
    first_ms = 1000 * (time.perf_counter() - started)  # builds the tokenizer's token trie too
    started = time.perf_counter()
    engine.grammars.matcher(StructuredOutput(json=ACTION))
    compile_ms = 1000 * (time.perf_counter() - started)
    started = time.perf_counter()
    engine.grammars.matcher(StructuredOutput(json=ACTION))
    cached_ms = 1000 * (time.perf_counter() - started)
    print(f"first schema (with the tokenizer's setup) {first_ms:.1f} ms; another schema {compile_ms:.1f} ms, "
          f"from the cache {cached_ms:.2f} ms")

    prompt = [{"role": "user", "content": "List some numbers as JSON."}]
    llm.chat([prompt], SamplingParams(max_tokens=4))  # warm up
    rows = []
    print(f"{'batch':>5}{'free tok/s':>12}{'schema tok/s':>14}{'overhead':>10}")
    for batch in (1, 16):
        rates = {}
        for name, params in (
            ("free", SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)),
            ("schema", SamplingParams(temperature=0, max_tokens=args.tokens, structured=StructuredOutput(json=LONG))),
        ):
            best = 0.0
            for _ in range(3):
                started = time.perf_counter()
                outputs = llm.chat([prompt] * batch, params)
                seconds = time.perf_counter() - started
                assert all(o.num_generated_tokens == args.tokens for o in outputs), [o.text for o in outputs]
                best = max(best, batch * args.tokens / seconds)
            rates[name] = best
        overhead = rates["free"] / rates["schema"] - 1
        rows.append({"batch": batch, "free_tokens_per_s": rates["free"], "schema_tokens_per_s": rates["schema"]})
        print(f"{batch:>5}{rates['free']:>12.1f}{rates['schema']:>14.1f}{100 * overhead:>9.1f}%")

    workload = make_workload("generative-agents", args.agents)
    turns = workload.turns(0, {})
    prompts = [[*t.messages[:-1], {**t.messages[-1], "content": t.messages[-1]["content"] + JSON_INSTRUCTION}]
               for t in turns]
    shares = {}
    for name, structured in (("free", None), ("response_format", StructuredOutput(json=ACTION))):
        outputs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=160, structured=structured))
        shares[name] = sum(valid(o.text) for o in outputs) / len(outputs)
        print(f"valid JSON answers, {name}: {sum(valid(o.text) for o in outputs)}/{len(outputs)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": engine.dtype, "cpu_capability": engine.cpu.capability,
                               "compile_ms": compile_ms, "cached_ms": cached_ms, "steps": rows,
                               "valid_share": shares}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
