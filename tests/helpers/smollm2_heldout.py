"""SmolLM2-135M-Instruct on held-out prompts for the shipped drafters' in-process tests: the
model in float32, the first chat and code prompts of the held-out sets (never trained on), and
plain greedy decoding's output to compare speculative decoding with."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.cluster.inprocess import InProcessCluster
from specmesh.data.prompts import load_prompts_file
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.training.eagle import PROMPTS_DIR
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams


@dataclass
class HeldOut:
    lm: object  # engine.loader.LoadedModel
    prompts: list[list[int]]  # chat-templated token ids
    sampling: SamplingParams
    plain: list[list[int]]  # plain greedy decoding's output ids, per prompt

    @property
    def eos(self) -> list[int]:
        return self.lm.config.eos_token_ids

    def cluster(self, num_speculative_tokens: int, **kw) -> InProcessCluster:  # noqa: ANN003
        """An in-process cluster of the target with ``kw`` (draft_method, proposer, ...)."""
        return InProcessCluster(self.lm.model, self.lm.config,
                                num_speculative_tokens=num_speculative_tokens,
                                eos_token_ids=self.eos, **kw)


def smollm2_heldout(num_chat: int = 2, num_code: int = 2, max_tokens: int = 32) -> HeldOut:
    """The first ``num_chat`` / ``num_code`` prompts of data/drafter_heldout_chat.jsonl and
    drafter_heldout_code.jsonl, with plain greedy decoding's ``max_tokens`` output of each."""
    lm = load_model(None, "float32")
    chat = load_prompts_file(str(PROMPTS_DIR / "drafter_heldout_chat.jsonl"))[:num_chat]
    code = load_prompts_file(str(PROMPTS_DIR / "drafter_heldout_code.jsonl"))[:num_code]
    prompts = chat_token_ids(lm.tokenizer, chat + code)
    sp = SamplingParams(max_tokens=max_tokens)
    out = HeldOut(lm, prompts, sp, [])
    out.plain = [o.token_ids for o in out.cluster(0).generate(prompts, sp)]
    return out


__all__ = ["HeldOut", "smollm2_heldout"]
