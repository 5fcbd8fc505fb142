"""Generation: a KV-cached decoder on the training mesh, and the uncached reference.

The generation room. It imports the models, the step, the checkpoints and `zerojax.hf`
(the CLI reads a train.py checkpoint or a Hugging Face folder).

    out = generate.generate(model, state.params, prompts, max_new=64, plan=built.plan)
    accuracy = generate.exact_match(model, state.params, held_out, 200, plan=built.plan)
    python -m zerojax.generate --workdir runs/sft --prompt "12+30="

`decode`: prefill + decode loop over a KV cache, params as the ZeRO plan holds them
(gathered whole once, or per layer per token), greedy or sampled; `cache`: the cache's
state, sharding and bytes (`cache_bytes`, which the planner shows); `sampling`:
temperature / top-k / top-p; `reference`: `greedy` without a cache (any model's logits,
whole params); `evaluate`: `exact_match`, `prompts_and_answers`; `cli`: the command.
"""

from zerojax.generate.cache import KVCache, cache_bytes
from zerojax.generate.cli import encode_prompt, main
from zerojax.generate.decode import Generated, decoder, generate
from zerojax.generate.evaluate import exact_match, prompts_and_answers
from zerojax.generate.reference import LogitsFn, greedy, greedy_jit
from zerojax.generate.sampling import Sampling

__all__ = ["Generated", "KVCache", "LogitsFn", "Sampling", "cache_bytes", "decoder",
           "encode_prompt", "exact_match", "generate", "greedy", "greedy_jit", "main",
           "prompts_and_answers"]
