"""DFlashPipeline: the public object. Text in, text out, lossless speculative decoding inside.

Contract:
- `DFlashPipeline.from_pretrained(model_dir=None, device="CPU", draft=True, cache_dir=None,
  precision=None, **compile_options)` reads an exported directory (ovdflash.manifest) and
  compiles both models with CACHE_DIR set. `precision` ("f32", the default, or "bf16") and the
  compile options decide the numerics as `ovdflash.ov.precision` says; `numerics` records them.
  `release_weight_pages` (default True) primes every kernel shape once and then drops the mapped IR
  files' resident pages, which the plugin no longer reads once it has repacked the weights.
  `wide_target` (None: where memory allows): a paged target with fp16 weights under f32 inference
  also gets an f32-weight copy for its calls of many tokens, timed at load (ovdflash.ov.wide_target;
  output unchanged: the same f32 arithmetic on the same weight values). No directory = the
  embedded default model (`ovdflash_models.default.ensure_default_model()`). `draft=False`
  compiles the target only (autoregressive baseline). `use_draft_vocab=False` ignores a
  shipped `drafter/draft_vocab.json` (full-vocabulary drafting head).
- `generate(prompt_or_messages, max_new_tokens, temperature, top_p, top_k, seed, stop,
  block_size, draft, apply_chat_template)` -> `GenerationResult(text, token_ids, finish_reason, stats)`.
  `stream(...)` yields text once per accepted block (the same text, in pieces);
  `stream_rounds(prompt, result, stop, **kwargs)` once per round, filling `result`. `draft=None`
  uses the drafter when one is loaded; `draft=False` (or block_size=1) is plain autoregressive.
  `block_size="auto"`: a `block_policy.BlockPolicy` picks the drafts per round (0 = AR step, at
  most the trained block - 1); its cost curves are measured on the real models at the first
  "auto" call (`auto_block_policy()`, ~2-6 s on SmolLM2) and it keeps learning acceptance
  across calls. `block_size=None` means `default_block_size`: from `from_pretrained`, the
  manifest's `default_block_size` ("auto" when absent; `ovdflash export --default-block-size`;
  the embedded default model fixes 4, ahead of 2 and level with "auto" on Zen 3-5 hosts:
  docs/BENCHMARKS.md), the trained block size (`block_size`) for a pipeline built directly.
  `generate_tokens(prompt_ids, ...)` is the token-level API (sequence.TokenEvent per token).
- `confidence_threshold` (attribute, default `block_policy.DEFAULT_CONFIDENCE_THRESHOLD`, 0..1): with a
  drafter that predicts each draft's acceptance (DSpark's confidence head), a fixed block verifies
  only the drafts before the first one whose predicted chance of being reached is below it (at
  least one; 0: never cut); "auto" chooses that length from its cost curve instead. Output unchanged.
- `prompt_lookup` (from_pretrained, default True; per call: None = the pipeline's): rounds whose
  text so far ends with an n-gram seen earlier in it verify the tokens that followed it instead
  of the drafter's (ovdflash.decode.lookup; output unchanged). Only with the drafter in use.
- A prompt is a string (encoded with the tokenizer's special tokens, and the manifest's
  `bos_token_id` in front if the tokenizer did not add it), a list of chat messages (rendered
  with the chat template, which carries its own special tokens), or a list of token ids.
  `apply_chat_template=True` renders a string as one user message instead, as openvino.genai's
  LLMPipeline does by default (ours stays a raw completion by default, like vLLM's `generate`
  and transformers' text pipelines: a string is the model's input as written); it has no effect
  on messages or token ids.
- Stops: an EOS id ends generation at that token (kept in token_ids, not in text); a stop
  string ends it at the token that completes it, mid-block or not, and is cut from the text;
  streaming holds back text that could be the start of a stop string. `max_new_tokens` is
  exact. Tokens equal to `mask_token_id` are ordinary output.
- `prefix_cache` (from_pretrained / constructor, default True; per call: None = the pipeline's):
  a call keeps the KV (and drafter context) of the longest prefix of its prompt that the previous
  call left in the runners (its prompt and committed output: a chat's earlier turns) and prefills
  only the rest (ovdflash.decode.prefix_cache; `stats.num_cached_prompt_tokens`). Output is unchanged.
  On a hybrid target it reuses only a prompt that extends the cached tokens. `prefix_store` is that
  cache; code that runs `target` or `drafter` itself calls `prefix_store.invalidate()`.
- Penalties, logit bias, logprobs: `generate`, `stream`, `stream_rounds`, `generate_tokens` and
  `generate_batch` take `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`
  ({token id: bias}) and `logprobs` (None, or 0..20 alternatives), as decode.sampling.SamplingParams
  and decode.logits_processors define them; DFlash output equals AR's with them on. With `logprobs`,
  `result.logprobs` and each TokenEvent's `logprob` carry the chosen token's logprob.
- Structured outputs: `generate`, `stream`, `stream_rounds`, `generate_tokens` and `generate_batch` take
  `structured` ({"json": schema}, {"json_object": True}, {"regex": ...}, {"choice": [...]}, {"grammar":
  lark}; decode.structured, compiled by ovdflash.grammar with llguidance): every token is held to the
  grammar, the output ends at the token that completes it, and DFlash output equals AR's under it.
- Stats: `last_stats` for the latest call, `stats` cumulative (ovdflash.decode.stats).

Layout: the class holds the state and streams text (`generate`, `stream`, `stream_rounds`); its
other methods are functions of the modules that own them, attached to the class: `loading`
(from_pretrained, release_weight_pages, warm_up), `token_generation` (generate_tokens),
`calibration` (auto_block_policy), `prompts` (encode_prompt), `batch_generation` (batch_target,
drafter_pool, batch_draft_policy, generate_batch). Imports: those modules, decode/, ov/ (never one
that loads openvino at import), text, tokenizer; never server/, bench/ or cli/.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from . import batch_generation, calibration, loading, text, token_generation
from .calibration import CALIBRATED_DRAFTS, CALIBRATION_PROMPT  # noqa: F401  (importers read them here)
from .decode.block_policy import DEFAULT_CONFIDENCE_THRESHOLD, BlockPolicy
from .decode.prefix_cache import PrefixCache
from .decode.stats import GenerationStats
from .loading import DEFAULT_CACHE_DIR, default_model_dir  # noqa: F401  (importers read them here)
from .ov.precision import Numerics
from .text import require_tokenizer
from .text import GenerationResult, check_stops, extend_text, held_back, record_token
from .token_generation import GenerationLock
from .tokenizer import IncrementalDetokenizer, Tokenizer


class DFlashPipeline:
    def __init__(self, target, drafter, tokenizer: Tokenizer | None, eos_token_ids: Sequence[int],
                 block_size: int, mask_token_id: int | None = None, model_dir: Path | None = None,
                 bos_token_id: int | None = None, default_block_size: int | str | None = None,
                 prompt_lookup: bool = True, prefix_cache: bool = True):
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.block_size = block_size  # the drafter's trained block: the largest "auto" verifies
        self.default_block_size = default_block_size if default_block_size is not None else block_size
        self.mask_token_id = mask_token_id
        self.model_dir = model_dir
        self.bos_token_id = bos_token_id  # prepended to plain-text prompts when the tokenizer does not
        self.stats = GenerationStats()       # cumulative
        self.last_stats = GenerationStats()  # latest call
        self.block_policy: BlockPolicy | None = None  # for block_size="auto"; built on first use
        self.confidence_threshold = DEFAULT_CONFIDENCE_THRESHOLD  # a fixed block's cut (block_policy.ConfidenceCut)
        self.prompt_lookup = prompt_lookup  # n-gram lookup drafts beside the drafter's (ovdflash.decode.lookup)
        self.prefix_cache = prefix_cache  # reuse the KV of the previous call's tokens (ovdflash.decode.prefix_cache)
        self.prefix_store = PrefixCache(target, drafter)  # what the runners hold between calls
        self.numerics: Numerics | None = None  # the target's precisions, when built by from_pretrained
        self.vocab_size: int | None = None  # token ids must be below it, when known
        self._lock = GenerationLock()  # one generation at a time: the runners hold one sequence's caches
        self._batch = batch_generation.BatchRunners()  # made on the first generate_batch

    # -- loading: ovdflash.loading -----------------------------------------------------------------
    from_pretrained = classmethod(loading.from_pretrained)
    release_weight_pages = loading.release_weight_pages
    warm_up = loading.warm_up

    # -- token level: ovdflash.token_generation, and the "auto" policy's calibration ---------------
    generate_tokens = token_generation.generate_tokens
    auto_block_policy = calibration.auto_block_policy

    # -- text level: prompts (ovdflash.text) in, text out --------------------------------------
    encode_prompt = text.encode_prompt

    def _blocks(self, prompt_or_messages, stop, result, apply_chat_template: bool, every_round: bool = False,
                **kwargs) -> Iterator[str]:
        """Text per accepted block (with `every_round`, one item per round, "" while text is held
        back); fills `result` (token_ids, text, finish_reason) as it goes."""
        stops = check_stops(stop)
        prompt_ids = self.encode_prompt(prompt_or_messages, apply_chat_template)
        detok = IncrementalDetokenizer(require_tokenizer(self.tokenizer))
        eos = set(self.eos_token_ids if kwargs.get("eos_token_ids") is None else kwargs["eos_token_ids"])
        events = self.generate_tokens(prompt_ids, **kwargs)
        text, emitted = "", 0
        try:
            for event in events:
                record_token(result, event)
                text, stopped = extend_text(text, event, detok, eos, stops)
                if stopped:  # this token completed a stop string: end here, mid-block or not
                    result.finish_reason = "stop"
                    break
                result.finish_reason = event.finish_reason
                if not event.from_draft or event.finish_reason:  # end of an accepted block
                    safe = len(text) if event.finish_reason else len(text) - held_back(text, stops)
                    if safe > emitted or every_round:
                        yield text[emitted:safe]
                        emitted = safe
        finally:
            events.close()  # also on Ctrl-C / consumer break: stats are recorded on close
            result.text = text
            result.stats = self.last_stats
        if len(text) > emitted:
            yield text[emitted:]

    def stream(self, prompt_or_messages, max_new_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
               block_size: int | str | None = None, draft: bool | None = None,
               apply_chat_template: bool = False, prompt_lookup: bool | None = None,
               prefix_cache: bool | None = None, **processing) -> Iterator[str]:
        result = GenerationResult("", [], "", GenerationStats())
        yield from self._blocks(prompt_or_messages, stop, result, apply_chat_template,
                                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, block_size=block_size, draft=draft,
                                prompt_lookup=prompt_lookup, prefix_cache=prefix_cache, **processing)

    def stream_rounds(self, prompt_or_messages, result: GenerationResult, stop=None,
                      apply_chat_template: bool = False, **kwargs) -> Iterator[str]:
        """`stream` with one item per round ("" when its text is held back), filling `result` as it
        goes: a caller stepping it (the server's scheduler) can stop between any two rounds."""
        return self._blocks(prompt_or_messages, stop, result, apply_chat_template, every_round=True, **kwargs)

    def generate(self, prompt_or_messages, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=None,
                 block_size: int | str | None = None, draft: bool | None = None,
                 apply_chat_template: bool = False, prompt_lookup: bool | None = None,
                 prefix_cache: bool | None = None, **processing) -> GenerationResult:
        result = GenerationResult("", [], "", GenerationStats())
        for _ in self._blocks(prompt_or_messages, stop, result, apply_chat_template,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, block_size=block_size, draft=draft,
                              prompt_lookup=prompt_lookup, prefix_cache=prefix_cache, **processing):
            pass
        return result

    # -- several sequences at once: ovdflash.batch_generation -------------------------------------
    batch_target = batch_generation.batch_target
    drafter_pool = batch_generation.drafter_pool
    batch_draft_policy = batch_generation.batch_draft_policy
    generate_batch = batch_generation.generate_batch
