"""The one decoding loop: prefill, then propose -> verify-forward -> verify -> rollback -> emit.

Plain decoding is the same loop with an empty proposal, so the two cannot drift apart; so is tree
decoding, since a chain draft is a token tree that is a path: every step scores the lead token and
a `TokenTree` of drafts in one target pass and keeps the accepted root-to-node path. Every
emitted token goes through `_Output.push`, which applies EOS, stop strings and max tokens one
token at a time: a stop inside an accepted run ends the output exactly where plain decoding would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .drafters import AdaptiveDraftLength, CostAwareDraftLength, NgramDrafter, SuffixDrafter
from .drafters.base import Drafter, Proposal, TreeDrafter, TreeShape
from .drafters.combined import LEARNED, LookupFirstDrafter, lookup_first, split_name
from .drafters.eagle import eagle_head_path, is_eagle_name, make_eagle_drafter
from .errors import InvalidRequestError, SpecdecError
from .models import loader
from .models.transformer import Transformer
from .sampling import SamplingParams, greedy_tokens, make_generator, process_logits, sample
from .tokenizer import Detokenizer, Tokenizer
from .verify import TokenTree, TreeVerdict, Verdict, first_proven_rejection, verify_greedy, verify_greedy_rows, \
    verify_sampling, verify_tree_greedy, verify_tree_sampling

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: str, quantize: str = "none") -> torch.dtype:
    if dtype == "auto":
        # bfloat16 halves the bytes read per token; CPUs without native bf16 would emulate it slowly.
        if device.startswith("cuda"):
            return torch.bfloat16
        if quantize != "none":
            # An int8 model on the CPU computes in float32 whatever the dtype (the compiled kernels'
            # activations, the float32 cache): bfloat16 would only round its norms' weights.
            return torch.float32
        return torch.bfloat16 if torch.backends.mkldnn.is_available() and _cpu_has_bf16() else torch.float32
    if dtype not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16", "dtype")
    return DTYPES[dtype]


def _cpu_has_bf16() -> bool:
    from .models.cpu_kernels import cpu_fields

    flags = cpu_fields().get("flags", "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda was asked for but no CUDA device is available", "device")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InvalidRequestError(f"unknown device {device!r}; choose cpu or cuda", "device")
    return device


def draft_model_path(name: str | None) -> Path | None:
    """The path of the draft model `name` names, or None for none / ngram / suffix.

    A preset name (`specdec models`) is its assembled GGUF file. Raises for a name that is neither
    a lookup drafter, a preset nor an existing folder or file.
    """
    from .models import presets

    if name in ("none", "", None, "ngram", "suffix"):
        return None
    if presets.is_preset(name):
        return presets.path(name)
    if (parts := split_name(name)) is not None:  # ngram+LEARNED: the learned drafter's path
        if parts[1] in ("none", "", "ngram", "suffix") or split_name(parts[1]):
            raise InvalidRequestError(f"drafter {name!r}: after {parts[0]}+ comes a learned drafter (eagle, "
                                      "eagle:DIR or a draft model's path)", "drafter")
        return draft_model_path(parts[1])
    if is_eagle_name(name):  # `eagle` (the shipped head) or `eagle:PATH`: the head's folder
        return eagle_head_path(name)
    path = Path(name).expanduser()
    if not path.exists():
        raise InvalidRequestError(
            f"unknown drafter {name!r}; choose none, ngram, suffix, a model preset ({', '.join(presets.PRESETS)}) "
            "or the path of a draft model (HF folder or .gguf file)", "drafter")
    return path


def make_drafter(name: str, target: Transformer | None = None, target_tokenizer: Tokenizer | None = None,
                 draft_p_min: float | None = None, progress=None, draft_quantize: str | None = None,
                 draft_vocab: int | None = None) -> Drafter | None:
    """none | ngram | suffix, or a draft model path: loaded on `target`'s device in its dtype.

    `draft_p_min` is the draft model's confidence cut-off (None = its default, 0 = off).
    `draft_quantize` is the draft model's quantisation: None or "auto" = the target's (an int8
    target gets an int8 draft, whose every draft token then costs int8 products too).
    `draft_vocab` N > 0: the draft model scores only its N most frequent ids (FR-Spec; see
    `drafters/draft_model.py`), still lossless.
    """
    from .drafters.draft_model import DEFAULT_DRAFT_P_MIN, DraftModelDrafter, check_draft_p_min

    if draft_p_min is not None:
        check_draft_p_min(draft_p_min)
    if (parts := split_name(name)) is not None:
        draft_model_path(name)  # the learned part must be one
        learned = make_drafter(parts[1], target, target_tokenizer, draft_p_min, progress, draft_quantize, draft_vocab)
        return lookup_first(make_drafter(parts[0]), learned)
    if is_eagle_name(name):
        if target is None:
            raise ValueError("an EAGLE head is made for a loaded target: pass `target`")
        return make_eagle_drafter(name, target, draft_p_min)
    path = draft_model_path(name)
    if path is None:
        if draft_p_min:
            raise InvalidRequestError("draft_p_min applies only to a draft model (a model path as drafter)",
                                      "draft_p_min")
        if name == "ngram":
            return NgramDrafter()
        if name == "suffix":
            return SuffixDrafter()
        return None
    if target is None:
        raise ValueError("a draft model is made for a loaded target: pass `target`")
    weight = target.embed_tokens.weight
    p_min = DEFAULT_DRAFT_P_MIN if draft_p_min is None else draft_p_min
    drafter = DraftModelDrafter.load(path, target.config.vocab_size, weight.dtype, weight.device, p_min,
                                     target_tokenizer, progress, quantize=draft_quantize_for(draft_quantize, target),
                                     vocab=draft_vocab)
    drafter.measure_cost(target)  # what the cost-aware draft length charges per draft token
    return drafter


def draft_quantize_for(draft_quantize: str | None, target: Transformer) -> str:
    """The draft model's quantisation: as asked, or ("auto" / None) the target's."""
    from .models.quant import Int8Linear

    if draft_quantize in (None, "auto"):
        return "int8" if isinstance(target.lm_head, Int8Linear) else "none"
    check_quantize(draft_quantize, str(target.embed_tokens.weight.device.type))
    return draft_quantize


def source_is_quantised(target: str) -> bool:
    """Whether a target's weights come quantised: the default model, a preset, a .gguf file."""
    from .models import presets

    return str(target) == "default" or presets.is_preset(str(target)) or str(target).lower().endswith(".gguf")


def resolve_quantize(quantize: str, device: str, target: str) -> str:
    """"auto" -> int8 on the CPU (where the int8 products are available) when the source weights
    are already quantised (a GGUF's 4-6 bit blocks: int8 keeps more than they hold, and runs ~5x
    faster than bfloat16 here), else none (float weights are kept as they are)."""
    from .models.quant import cpu_int8_available

    if quantize != "auto":
        return quantize
    return "int8" if device == "cpu" and cpu_int8_available() and source_is_quantised(target) else "none"


def resolve_drafter(drafter: str, target: str, draft_p_min: float | None = None) -> tuple[str, float | None]:
    """(drafter, draft_p_min): "auto" -> a preset target's paired draft model, with the pair's
    confidence cut-off unless one is given (chat answers have little to copy: prompt lookup first
    measured slower, its weak matches taking the place of the model's drafts); else prompt lookup,
    which the cost-aware draft length turns down where it finds nothing to copy."""
    from .models import presets

    if drafter != "auto":
        return drafter, draft_p_min
    if presets.is_preset(str(target)) and (pair := presets.get(str(target))).draft:
        return pair.draft, pair.draft_p_min if draft_p_min is None else draft_p_min
    return "ngram", draft_p_min


def _no_trees(name: str) -> InvalidRequestError:
    return InvalidRequestError(f"drafter {name!r} cannot propose draft trees; eagle, ngram and ngram+eagle can", "draft_tree")


DRAFT_LENGTHS = ("fixed", "adaptive", "cost")
# The cost-aware draft length's step-cost model, 1 + overhead + cost * k for a verify pass over k
# drafts, in plain steps (see `CostAwareDraftLength`). Measured on the 2-core AVX2 CPU with the
# default model (a pass over T tokens relative to T = 1): float32 1.73 at T = 2, 2.31 at T = 6, 2.60
# at T = 9 after a 100-token context (its matrix products leave their one-row fast path); int8, with
# the compiled CPU kernels, after a 400-token context: 1.02 at T = 2, 1.51 at T = 4, 1.88 at T = 6,
# 2.16 at T = 9 (BENCHMARKS.md, evening run). A GPU scores a few tokens for about one: the CUDA row is
# an estimate, not yet measured on a GPU.
DEFAULT_VERIFY_COSTS = {  # (overhead, cost per draft token)
    "cpu": (0.5, 0.14),
    "cpu-int8": (0.0, 0.16),
    "cuda": (0.0, 0.03),
}
# The output head's share of that per-token cost, which greedy screening pays only for rows up to
# the first rejection (`CostAwareDraftLength.screened_share`). int8, 400-token context: the head
# grows by ~0.07-0.08 plain steps a row and the rest of the pass by ~0.075-0.095 (BENCHMARKS.md,
# 3 December, evening and night).
SCREENED_SHARE = {"cpu-int8": 0.45}


def default_draft_length(draft_length: str | None, tree) -> str:
    """None means the measured best: "cost" for chains (BENCHMARKS.md, Spec-Bench mix on the int8
    target, 2-core CPU: prompt lookup 1.77x plain with it, 1.60x with a fixed k = 5; a tie in
    float32); a tree has a fixed shape."""
    if draft_length is not None:
        return draft_length
    return "fixed" if tree is not None else "cost"


def check_draft_length(draft_length: str, verify_cost: float | None, verify_overhead: float | None = None) -> None:
    if draft_length not in DRAFT_LENGTHS:
        raise InvalidRequestError(f"draft_length must be one of {', '.join(DRAFT_LENGTHS)}; got {draft_length!r}",
                                  "draft_length")
    if verify_cost is not None and not (isinstance(verify_cost, (int, float)) and 0 < verify_cost <= 10):
        raise InvalidRequestError(f"verify_cost must be a number in (0, 10], got {verify_cost!r}", "verify_cost")
    if verify_overhead is not None and not (isinstance(verify_overhead, (int, float)) and 0 <= verify_overhead <= 10):
        raise InvalidRequestError(f"verify_overhead must be a number in [0, 10], got {verify_overhead!r}",
                                  "verify_overhead")


def check_quantize(quantize: str, device: str) -> None:
    """`quantize` on a resolved device: int8 runs on the CPU, with PyTorch's fbgemm backend."""
    from .models.quant import QUANT_MODES, cpu_int8_available

    if quantize not in QUANT_MODES:
        raise InvalidRequestError(f"unknown quantize {quantize!r}; choose {' or '.join(QUANT_MODES)}", "quantize")
    if quantize != "none" and (device != "cpu" or not cpu_int8_available()):
        raise InvalidRequestError("quantize=int8 needs the CPU with PyTorch's fbgemm backend", "quantize")


def check_speculation(num_speculative_tokens: int, draft_length: str, tree, verify_cost: float | None,
                      verify_overhead: float | None) -> None:
    """The speculation options that need no model: `Engine.load` checks them before the slow load,
    the constructor again for engines built around a loaded model."""
    if num_speculative_tokens < 1:
        raise InvalidRequestError("num_speculative_tokens must be >= 1", "num_speculative_tokens")
    check_draft_length(draft_length, verify_cost, verify_overhead)
    if tree is not None and draft_length != "fixed":
        raise InvalidRequestError(f"draft_length {draft_length!r} moves a chain's length; a draft tree "
                                  "has a fixed shape", "draft_length")


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    tokens_per_s: float = 0.0
    drafts: int = 0  # verify steps that had at least one draft token
    draft_tokens: int = 0  # drafted tokens scored by the target (all nodes of a tree)
    accepted_tokens: int = 0
    # Per draft position (depth i + 1 in a tree): steps that accepted a token there, and steps whose
    # draft reached it (with one or more candidates), so their ratio is the acceptance rate at
    # that position given the draft got there, for chains and trees alike.
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / drafts, as vLLM reports it (tokens per verify step that drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d


@dataclass
class Step:
    """What one target pass produced, for --show-drafts."""

    accepted: list[int]
    next_token: int
    kind: str  # "recovered" | "bonus" | "prefill"
    drafted: int  # draft tokens the target scored (tree nodes for a tree)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: Stats
    steps: list[Step]


class _Output:
    """Collects emitted tokens, applying EOS, stop strings and the token limit one token at a time."""

    def __init__(self, tokenizer, eos_ids, stop, max_new_tokens):
        self.detok = Detokenizer(tokenizer)
        self.eos_ids = set(eos_ids)
        self.stop = [s for s in (stop or []) if s]
        self.max_new = max_new_tokens
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.text_end: int | None = None  # cut point of the text when a stop string matched

    def push(self, token: int) -> str:
        self.ids.append(token)
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return ""
        delta = self.detok.push(token)
        if self.stop and delta:
            text = self.detok.text
            window = len(delta) + max(len(s) for s in self.stop)
            hits = [i for s in self.stop if (i := text.find(s, max(0, len(text) - window))) >= 0]
            if hits:
                self.text_end = min(hits)
                self.finish_reason = "stop"
                emitted_before = len(text) - len(delta)
                return text[emitted_before : max(emitted_before, self.text_end)]
        if len(self.ids) >= self.max_new:
            self.finish_reason = "length"
        return delta

    @property
    def text(self) -> str:
        text = self.detok.text
        return text if self.text_end is None else text[: self.text_end]


class Engine:
    """Speculative decoding of one request at a time.

    The drafter proposes a chain of up to `num_speculative_tokens` tokens per step: `draft_length`
    "cost" (the default for chains) picks, per kind of proposal, the length with the best expected
    speedup for the acceptance measured so far and the step-cost model (`verify_overhead`,
    `verify_cost`; defaults in DEFAULT_VERIFY_COSTS; see `CostAwareDraftLength`);
    "fixed" always asks for k; "adaptive" moves k by the +2/-1 rule. Or, with `draft_tree` (a
    `TreeShape` or its `DEPTHxTOPKxBUDGET` string), a token tree from its `propose_tree`: several
    candidates per position, all scored in the same single target pass.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 5,
        draft_length: str | None = None,
        draft_tree: TreeShape | str | None = None,
        verify_cost: float | None = None,
        verify_overhead: float | None = None,
        screen_verify: bool = True,
    ):
        tree = TreeShape.parse(draft_tree) if isinstance(draft_tree, str) else draft_tree
        draft_length = default_draft_length(draft_length, tree)
        check_speculation(num_speculative_tokens, draft_length, tree, verify_cost, verify_overhead)
        if tree is not None and not isinstance(drafter, TreeDrafter):
            raise _no_trees(getattr(drafter, "name", "none") if drafter is not None else "none")
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.draft_length = draft_length
        self.draft_tree: TreeShape | None = tree
        self.verify_cost, self.verify_overhead = verify_cost, verify_overhead
        # Greedy chains on a target whose head can score chosen columns exactly (int8 on the CPU)
        # are verified with the head's full product only up to the first certain rejection.
        self.screen_verify = screen_verify and self._head_columns_exact()

    @classmethod
    def load(
        cls,
        target: str = "default",
        drafter: str = "auto",
        num_speculative_tokens: int = 5,
        device: str = "cpu",
        dtype: str = "auto",
        draft_length: str | None = None,
        progress=None,
        draft_p_min: float | None = None,
        quantize: str = "auto",
        draft_tree: TreeShape | str | None = None,
        verify_cost: float | None = None,
        verify_overhead: float | None = None,
        screen_verify: bool = True,
        draft_quantize: str | None = None,
        draft_vocab: int | None = None,
    ) -> "Engine":
        """Load a target (and drafter) ready to generate.

        `draft_tree` (e.g. "5x4x24", see `TreeShape`) drafts token trees instead of chains; the
        drafter must be one that proposes trees (eagle, ngram).

        `quantize="int8"` replaces the target's linear layers and output head by int8 weight-only
        versions (CPU only; see `models/quant.py`). That changes the target model itself, so plain
        and speculative decoding are compared on the same quantised target. "auto" (the default)
        is int8 on the CPU for a source that is already quantised (`resolve_quantize`).

        `drafter="auto"` (the default) is prompt lookup, or for a preset target with a paired draft
        model, that draft model (`resolve_drafter`). `draft_quantize` sets the
        draft model's quantisation (default: the target's).
        """
        device = resolve_device(device)
        quantize = resolve_quantize(quantize, device, target)
        drafter, draft_p_min = resolve_drafter(drafter, target, draft_p_min)
        if draft_quantize not in (None, "auto"):
            check_quantize(draft_quantize, device)
        from .drafters.draft_model import check_vocab

        check_vocab(draft_vocab)
        if isinstance(draft_tree, str):
            draft_tree = TreeShape.parse(draft_tree)  # a malformed shape fails before the load
        draft_length = default_draft_length(draft_length, draft_tree)
        check_speculation(num_speculative_tokens, draft_length, draft_tree, verify_cost, verify_overhead)
        torch_dtype = resolve_dtype(dtype, device, quantize)
        check_quantize(quantize, device)
        # A bad drafter name or option fails before the slow target load; a draft model is loaded
        # after the target, whose vocabulary, device and dtype it takes.
        draft_path = draft_model_path(drafter)
        made = None if draft_path else make_drafter(drafter, draft_p_min=draft_p_min)
        parts = split_name(drafter)
        tree_names = is_eagle_name(drafter) or (parts is not None and parts[0] == "ngram" and is_eagle_name(parts[1]))
        if draft_tree is not None and not tree_names and not isinstance(made, TreeDrafter):
            raise _no_trees(drafter)
        # The tokenizer first: reading Gemma's 262k-token vocabulary peaks at ~0.5 GB of parser
        # temporaries, which are handed back before the weights arrive rather than on top of them.
        folder = loader.resolve(target, progress)
        loader.read_config(folder)  # a bad config fails before the tokenizer is read
        tokenizer = Tokenizer.from_folder(folder)
        loader.release_freed_memory()
        model, _ = loader.load(folder, torch_dtype, device, progress, quantize)
        if draft_path:
            made = make_drafter(drafter, model, tokenizer, draft_p_min, progress, draft_quantize, draft_vocab)
        return cls(model, tokenizer, made, num_speculative_tokens, draft_length, draft_tree, verify_cost,
                   verify_overhead, screen_verify)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def generate(
        self,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: str | list[str] | None = None,
        speculative: bool = True,
        on_text=None,
    ) -> Generation:
        """Generate a continuation. `on_text(delta)` receives text as it is produced (streaming)."""
        sampling = sampling or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_ids)
        if max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1", "max_tokens")
        cfg = self.model.config
        if len(ids) + max_new_tokens > cfg.max_position:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's context of "
                f"{cfg.max_position} tokens",
                "max_tokens",
            )
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        drafter = self.drafter if speculative else None
        generator = make_generator(sampling.seed, self.device)
        stats = Stats(prompt_tokens=len(ids))
        out = _Output(self.tokenizer, cfg.eos_token_ids, stop, max_new_tokens)
        steps: list[Step] = []
        emit = on_text or (lambda delta: None)
        length = self._draft_length_rule(sampling.greedy)

        start = time.perf_counter()
        # Room for the longest verify block: the lead token + k chain drafts or `budget` tree nodes.
        room = self.draft_tree.budget if self.draft_tree is not None else self.k
        cache = self.model.new_cache(1, len(ids) + max_new_tokens + room + 1)
        tokens = torch.tensor([ids], device=self.device)
        # Learned drafters (EAGLE-style) read the target's own features: they get the final hidden
        # state of every token the target's cache now holds, in order (`observe`, optional). Without
        # one, the prefill's last layer runs for the last token only (`Transformer.forward`).
        observe = getattr(drafter, "observe", None) if drafter is not None else None
        logits, hidden = self.model(tokens, torch.arange(len(ids), device=self.device)[None], cache, last_n=1,
                                    need_hidden=observe is not None)
        stats.target_forwards += 1
        first = self._pick(logits[0], sampling, generator)
        stats.prefill_s = time.perf_counter() - start
        steps.append(Step([], first, "prefill", 0))
        emit(out.push(first))
        if drafter is not None:
            drafter.begin(list(ids), sampling, generator)
            if observe is not None:
                observe(hidden[0])  # [prompt_len, hidden]

        while out.finish_reason is None:
            context = ids + out.ids
            # Never draft past the token allowance: those tokens could not be emitted.
            tree, q, source = self._draft(drafter, context, max_new_tokens - len(out.ids), length)
            # The last emitted token is not in the cache yet: it leads the verify block (the tree's
            # root, block position 0; node i is block position i + 1, at its depth's position).
            base = len(context) - 1
            block = torch.tensor([[context[-1]] + tree.tokens], device=self.device)
            positions = base + torch.tensor([[0] + tree.depths()], device=self.device)
            # A path needs only the causal mask; a tree lets each node see just its ancestors.
            mask = None if tree.is_chain else tree.mask()[None].to(self.device)
            screen = self.screen_verify and sampling.greedy and tree.is_chain and len(tree) > 0
            logits, hidden = self.model(block, positions, cache, mask=mask, last_n=0 if screen else None)
            stats.target_forwards += 1
            if screen:
                verdict = self._verify_screened(hidden[0], tree.tokens, context)
            else:
                verdict = self._verify_tree(logits[0], tree, q, sampling, generator)
            # Roll back: keep the lead token and the accepted path; the verdict's next token leads
            # the following block. A chain's path is a prefix of the block, so moving the length is
            # enough; a tree's path is packed into consecutive slots first.
            keep = [0] + [i + 1 for i in verdict.path]  # block positions, increasing
            if verdict.path == list(range(verdict.num_accepted)):
                cache.truncate(base + len(keep))
            else:
                cache.compact(keep, base)
            self._count(stats, len(tree), verdict.num_accepted, max(tree.depths(), default=0))
            if drafter is not None:
                if observe is not None:
                    observe(hidden[0, keep])  # lead token + accepted path, in order
                drafter.feedback(verdict.num_accepted)
            if length is not None and len(tree):
                length.update(len(tree), verdict.num_accepted, source)
            steps.append(Step(list(verdict.accepted), verdict.next_token, verdict.kind, len(tree)))
            for token in verdict.tokens:
                emit(out.push(token))
                if out.finish_reason is not None:
                    break

        if drafter is not None:
            drafter.end(list(out.ids))
        stats.wall_s = time.perf_counter() - start
        stats.new_tokens = len(out.ids)
        decode_s = stats.wall_s - stats.prefill_s
        stats.tokens_per_s = (stats.new_tokens - 1) / decode_s if decode_s > 0 and stats.new_tokens > 1 else 0.0
        return Generation(out.ids, out.text, out.finish_reason, stats, steps)

    def _prompt_ids(self, prompt, prompt_ids) -> list[int]:
        if (prompt is None) == (prompt_ids is None):
            raise InvalidRequestError("give exactly one of prompt or prompt_ids", "prompt")
        if prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass prompt_ids", "prompt")
            return self.tokenizer.encode(prompt)
        ids = list(prompt_ids)
        vocab = self.model.config.vocab_size
        if not ids:
            raise InvalidRequestError("prompt_ids is empty", "prompt")
        if any(not isinstance(i, int) or i < 0 or i >= vocab for i in ids):
            raise InvalidRequestError(f"prompt_ids must be integers in [0, {vocab})", "prompt")
        return ids

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
        # logits: [1, vocab] (the last position)
        if sampling.greedy:
            return greedy_tokens(logits[-1:])[0]
        return int(sample(process_logits(logits[-1], sampling), generator))

    @staticmethod
    def _verify(logits, proposal: Proposal, draft, sampling, generator) -> Verdict:
        # logits: [len(draft) + 1, vocab]
        if sampling.greedy:
            return verify_greedy(logits, draft)
        q = None if proposal.q is None else proposal.q[: len(draft)]
        return verify_sampling(process_logits(logits, sampling), q, draft, generator)

    def _draft_length_rule(self, greedy: bool) -> AdaptiveDraftLength | CostAwareDraftLength | None:
        """This request's draft-length rule (fresh per request, so a seeded request reproduces)."""
        if self.draft_length == "adaptive":
            return AdaptiveDraftLength(self.k, max(self.k, 16))
        if self.draft_length == "cost":
            overhead, cost = DEFAULT_VERIFY_COSTS[self._hardware_kind()]
            cost = cost if self.verify_cost is None else self.verify_cost
            overhead = overhead if self.verify_overhead is None else self.verify_overhead
            share = SCREENED_SHARE.get(self._hardware_kind(), 0.0) if self.screen_verify and greedy else 0.0
            priced = self._draft_costs()
            if priced:
                from .drafters.draft_model import PricedDraftLength

                return PricedDraftLength(self.k, cost, overhead, share, draft_costs=priced)
            return CostAwareDraftLength(self.k, cost, overhead, share)
        return None

    def _draft_costs(self) -> dict:
        """Proposal source -> the measured cost of one draft token (a draft model's `draft_cost`),
        for the kinds a model drafts: the drafter's own (None) or, after lookup, LEARNED."""
        drafter = self.drafter
        learned = getattr(drafter, "learned", None)
        cost = getattr(learned if learned is not None else drafter, "draft_cost", None)
        if not cost:
            return {}
        return {LEARNED if learned is not None else None: cost}

    def _hardware_kind(self) -> str:
        """The DEFAULT_VERIFY_COSTS row for this target: cuda, cpu-int8 or cpu."""
        from .models.quant import Int8Linear

        if self.device.type == "cuda":
            return "cuda"
        return "cpu-int8" if isinstance(self.model.lm_head, Int8Linear) else "cpu"

    def _draft(self, drafter, context: list[int], allowance: int, length):
        """This step's drafts as a tree (a chain is a path), their q ([nodes, vocab] or None) and
        the proposal's `source` (what kind of guess it is, for the draft-length rule).

        Tree candidates are deterministic given the context (`TreeDrafter.propose_tree`), so a
        tree carries no q: verification treats each node as one-hot, which is exact.
        """
        if drafter is None:
            return TokenTree([], []), None, None
        if self.draft_tree is not None:
            shape = self.draft_tree
            tree = drafter.propose_tree(context, min(shape.depth, allowance), shape.top_k, shape.budget)
            if len(tree) > shape.budget:
                raise ValueError(f"{drafter.name} proposed {len(tree)} tree nodes, over the budget of {shape.budget}")
            return tree, None, None
        if length is None:
            k = self.k
        elif getattr(drafter, "labels_proposals", False):
            # A lookup's kind is known once it is found, and looking up is free: ask for the most
            # the rule may keep, then keep what it wants for that kind.
            k = length.k_max
        else:
            # A model drafter drafts at least one token, unless its price is known and its measured
            # acceptance does not pay for it: then this is a plain step.
            k = length.next_k() if self._draft_costs() else max(1, length.next_k())
            if k == 0:
                return TokenTree([], []), None, None
        k = min(k, allowance)
        if isinstance(drafter, LookupFirstDrafter) or hasattr(drafter, "learned"):
            # Where lookup finds nothing, the learned drafter drafts what the rule wants for its
            # kind (a fixed length: k; a priced drafter whose drafts do not pay: none).
            fallback = k if length is None else length.next_k(LEARNED)
            if not self._draft_costs():
                fallback = max(1, fallback)
            proposal = drafter.propose(context, k, fallback_k=fallback)
        else:
            proposal = drafter.propose(context, k)
        if length is not None:
            k = min(k, length.next_k(proposal.source))
        q = None if proposal.q is None else proposal.q[:k]
        return TokenTree.chain(proposal.tokens[:k]), q, proposal.source

    def _head_columns_exact(self) -> bool:
        """Whether the target's head scores chosen columns bit-identically (`head_columns`)."""
        probe = torch.zeros(1, self.model.config.hidden_size, dtype=self.model.embed_tokens.weight.dtype,
                            device=self.device)
        with torch.inference_mode():
            return self.model.head_columns(probe, torch.zeros(1, dtype=torch.long, device=self.device)) is not None

    def _verify_screened(self, hidden: torch.Tensor, draft: list[int], context: list[int]) -> TreeVerdict:
        """Greedy verification of a chain that computes the full output head only on the rows that
        can matter. hidden: [len(draft) + 1, hidden size], the verify block's final hidden states.

        The block's rows are first scored on a few hundred columns: every token of the context and
        of the draft (where a greedy target's next token mostly is). A row whose draft token loses
        there is certainly rejected (`first_proven_rejection`), so no later row is needed; the
        full head (262k columns for Gemma 3, most of a one-token step) then runs on the rows up to
        it only. Same verdict as scoring every row (`verify_greedy_rows`).
        """
        ids = torch.tensor(sorted(set(context).union(draft)), device=hidden.device)
        columns = self.model.head_columns(hidden[: len(draft)], ids)
        rows = len(draft) if columns is None else first_proven_rejection(columns, ids, draft)
        v = verify_greedy_rows(self.model.head(hidden[: rows + 1]), draft)
        return TreeVerdict(v.accepted, v.next_token, v.kind, path=list(range(v.num_accepted)))

    @staticmethod
    def _verify_tree(logits, tree: TokenTree, q, sampling, generator) -> TreeVerdict:
        # logits: [len(tree) + 1, vocab]; q: [len(tree), vocab] or None (one-hot)
        if tree.is_chain:
            # A path: the chain rules decide exactly as the tree rules would (greedy: the same
            # verdict; sampling: the same distribution), vectorised, and with the random draws
            # chain decoding has always made, so a seed keeps its output.
            v = Engine._verify(logits, Proposal(tree.tokens, q), tree.tokens, sampling, generator)
            return TreeVerdict(v.accepted, v.next_token, v.kind, path=list(range(v.num_accepted)))
        if sampling.greedy:
            return verify_tree_greedy(logits, tree)
        return verify_tree_sampling(process_logits(logits, sampling), q, tree, generator)

    @staticmethod
    def _count(stats: Stats, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One verify step: `drafted` tokens scored, reaching `depth` positions (a chain's depth is
        its length, the default; a tree's its deepest level), `accepted` of them on the path."""
        if not drafted:
            return
        depth = drafted if depth is None else depth
        stats.drafts += 1
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        while len(stats.drafted_per_position) < depth:
            stats.drafted_per_position.append(0)
            stats.accepted_per_position.append(0)
        for i in range(depth):
            stats.drafted_per_position[i] += 1
            if i < accepted:
                stats.accepted_per_position[i] += 1


__all__ = ["Engine", "Generation", "Stats", "SpecdecError"]
