"""Grammar libraries for constrained decoding on this CPU, side by side: llguidance (what the
engine uses) against xgrammar (vLLM's and SGLang's default), on the default model's tokenizer.

    python benchmarks/grammars.py --tokenizer DIR   # a Hugging Face tokenizer folder of the model

Needs `llguidance`, `xgrammar` and `transformers` in one environment (the engine needs only
llguidance; xgrammar pulls in triton, so it is not a dependency). For each JSON schema: compile
time (cold, and again from the library's cache), then a walk through a valid instance of the
schema, token by token: the time to compute each next-token mask, and to accept the token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CASES = [
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Klaus Mueller", "age": 34}),
    ({"type": "object", "properties": {"next_action": {"enum": ["talk", "walk", "sleep", "work"]},
                                       "target": {"type": "string", "maxLength": 16},
                                       "reason": {"type": "string"}},
      "required": ["next_action", "target", "reason"]},
     {"next_action": "talk", "target": "Isabella", "reason": "to plan the Valentine's Day party at Hobbs Cafe"}),
    ({"type": "object", "properties": {"plan": {"type": "array", "items": {"type": "object", "properties": {
        "hour": {"type": "integer"}, "activity": {"type": "string"}}, "required": ["hour", "activity"]}}},
      "required": ["plan"]},
     {"plan": [{"hour": 8, "activity": "wake up and have breakfast"}, {"hour": 9, "activity": "open the pharmacy"},
               {"hour": 12, "activity": "lunch with Maria"}, {"hour": 18, "activity": "read a novel at home"}]}),
    ({"type": "array", "items": {"type": "number"}}, [0.5, 12, 3.25, 100, 7]),
    ({"type": "object", "properties": {"location": {"type": "object", "properties": {
        "lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}, "required": ["location", "tags"]},
     {"location": {"lat": 48.8566, "lon": 2.3522}, "tags": ["city", "capital", "river"]}),
]


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def walk(tokens: list[int], compute_mask, accept) -> tuple[list[float], list[float], str | None]:
    """Mask, then accept, each token of a valid output: (mask seconds, accept seconds, error)."""
    masks, accepts = [], []
    for token in tokens:
        masks.append(timed(compute_mask)[1])
        ok, seconds = timed(lambda: accept(token))
        accepts.append(seconds)
        if not ok:
            return masks, accepts, f"rejected token {token}"
    return masks, accepts, None


def run_llguidance(hf_tokenizer, schema: dict, tokens: list[int]):
    import llguidance
    import llguidance.hf
    import torch

    from tokendance.structured import JSON_OPTIONS

    lltok = getattr(run_llguidance, "tokenizer", None) or llguidance.hf.from_tokenizer(hf_tokenizer)
    run_llguidance.tokenizer = lltok
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    _, cold = timed(lambda: llguidance.LLMatcher(lltok, grammar, log_level=0))
    matcher, warm = timed(lambda: llguidance.LLMatcher(lltok, grammar, log_level=0))
    mask = torch.empty((lltok.vocab_size + 31) // 32, dtype=torch.int32)
    return (cold, warm, *walk(tokens, lambda: matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4),
                              matcher.consume_token))


def run_xgrammar(hf_tokenizer, schema: dict, tokens: list[int]):
    import xgrammar

    info = getattr(run_xgrammar, "info", None) or xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer)
    run_xgrammar.info = info
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
    text = json.dumps(schema)
    _, cold = timed(lambda: compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": ")))
    compiled, warm = timed(lambda: compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": ")))
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    return (cold, warm, *walk(tokens, lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer folder of the model")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    import torch

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"{'library':<11}{'schema':>7}{'tokens':>7}{'compile ms':>11}{'cached ms':>10}"
          f"{'mask us (mean / p99)':>22}{'accept us':>10}")
    for library, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        all_masks = []
        for index, (schema, instance) in enumerate(CASES):
            tokens = tokenizer.encode(json.dumps(instance), add_special_tokens=False) + [tokenizer.eos_token_id]
            cold, warm, masks, accepts, error = run(tokenizer, schema, tokens)
            all_masks += masks
            p99 = sorted(masks)[int(0.99 * (len(masks) - 1))]
            print(f"{library:<11}{index:>7}{len(tokens):>7}{1000 * cold:>11.2f}{1000 * warm:>10.2f}"
                  f"{1e6 * statistics.mean(masks):>13.0f} / {1e6 * p99:>6.0f}{1e6 * statistics.mean(accepts):>10.0f}"
                  f"{'  ' + error if error else ''}")
        print(f"{library:<11}   all masks: mean {1e6 * statistics.mean(all_masks):.0f} us, "
              f"max {1e6 * max(all_masks):.0f} us over {len(all_masks)} steps")


if __name__ == "__main__":
    main()
