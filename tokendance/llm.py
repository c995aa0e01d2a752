"""`LLM`: the offline Python API over the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from tqdm.auto import tqdm

from tokendance.config import EngineConfig
from tokendance.engine.llm_engine import LLMEngine
from tokendance.errors import CapacityError, ContextLengthError, InvalidRequestError
from tokendance.model.loader import LoadedModel
from tokendance.outputs import RequestOutput
from tokendance.engine.rounds import RoundResult, RoundRunner
from tokendance.reuse.segments import AgentTurn, chat_token_ids, validate_messages
from tokendance.sampling import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """`LLM(model=None)` loads the default model (SmolLM2-135M-Instruct); `model` may also be a
    GGUF file, a Hugging Face folder or an already `LoadedModel`. Keyword arguments are
    `EngineConfig` fields (dtype, kv_cache_bytes, block_size, ...)."""

    def __init__(self, model: str | LoadedModel | None = None, **engine_args):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise InvalidRequestError(f"unknown engine arguments: {', '.join(unknown)}")
        if isinstance(model, LoadedModel):
            self.engine = LLMEngine(EngineConfig(**engine_args), loaded=model)
        else:
            self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.rounds = RoundRunner.for_engine(self.engine)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        namespace: str = "",
    ) -> list[RequestOutput]:
        """One output per prompt and choice, in order (a prompt's `n` choices in a row). All
        prompts are validated before any is scheduled. A prompt's choices after the first start
        once it has computed the prompt, and find it in the prefix cache."""
        batch = _as_prompt_batch(prompts)
        params = _as_params(self.default_sampling_params() if sampling_params is None else sampling_params, len(batch))
        requests, after = [], []
        for prompt, p in zip(batch, params):
            first = self.engine.make_request(prompt, p.choice(0), namespace=namespace)
            requests.append(first)
            after.append(None)
            for index in range(1, p.n):
                requests.append(self.engine.make_request(prompt, p.choice(index),
                                                         namespace=namespace, group=first.request_id))
                after.append(first.request_id)
        outputs = self._run(requests, use_tqdm, after)
        firsts = {request.request_id: output for request, leader, output in zip(requests, after, outputs)
                  if leader is None}
        for leader, output in zip(after, outputs):  # later choices share the first one's prompt scores
            if leader is not None and output.prompt_logprobs is None:
                output.prompt_logprobs, output.prompt_logits = firsts[leader].prompt_logprobs, firsts[leader].prompt_logits
        return outputs

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given none: the model's generation_config.json
        sampling (temperature, top_p, top_k, repetition_penalty) where it has one."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate its reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_token_ids(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_token_ids(self, messages: Sequence[Message]) -> list[int]:
        """A conversation's prompt ids, as `chat`, rounds and the server tokenize it: message by
        message, so a message has the same ids wherever it sits."""
        validate_messages(messages)
        self.engine.check_chat_size(messages)
        return chat_token_ids(self.tokenizer, messages)

    def render_chat(self, messages: Sequence[Message]) -> str:
        validate_messages(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def run_round(
        self,
        turns: Sequence[AgentTurn],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> RoundResult:
        """Run one round of agent turns together; agents keep their KV between rounds (sessions)
        and shared spans are reused as the `reuse` mode says. Outputs come in the turns' order.
        `sampling_params`: one for every turn, or one per turn."""
        return self.rounds.run(turns, self.default_sampling_params() if sampling_params is None else sampling_params)

    def warm_up(self) -> None:
        """Two small untimed rounds of a two-agent Generative Agents simulation (a master and a
        mirror: every path a round takes), so every compiled kernel path has seen realistic shapes
        before anything is timed or served (the first real round would otherwise pay ~4 s of
        compilation); their sessions are ended. Two agents instead of three: 13.1 s instead of
        18.8 s under a simulated AVX2 on one thread, the next rounds as fast."""
        from tokendance.workloads import GenerativeAgents

        workload = GenerativeAgents(2, seed=12345)
        try:
            history = []
            for r in range(2):
                self.run_round(workload.turns(r, history), SamplingParams(temperature=0, max_tokens=3))
                history.append(workload.synthetic_outputs(r))
        except (CapacityError, ContextLengthError):  # a pool or context this small cannot hold it: nothing to warm
            pass
        finally:
            for agent in workload.agents:
                self.end_agent(agent)

    def end_agent(self, agent_id: str) -> bool:
        """Drop an agent's session (its KV); False if it had none."""
        return self.rounds.end_agent(agent_id)

    def _run(self, requests, use_tqdm: bool, after: list[str | None] | None = None) -> list[RequestOutput]:
        order = {r.request_id: i for i, r in enumerate(requests)}
        for request, leader in zip(requests, after or [None] * len(requests)):
            self.engine.add(request, after=leader)
        results: list[RequestOutput | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                for output in self.engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
        return results


def _as_prompt_batch(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of those")


def _as_params(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"{len(params)} sampling params for {count} prompts")
    return params
