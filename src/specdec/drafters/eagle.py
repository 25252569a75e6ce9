"""EAGLE-style drafter: a one-layer head that drafts from the target's own features.

The head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
predicts the target's next *feature* rather than the next token directly: the output head turns a
feature into a token distribution, and features are far more regular than tokens.

One head step, for a token x_j at position j whose predecessor's feature f_{j-1} is known:

    z       = fc([f_{j-1} ; embed(x_j)])                         2h -> h
    f^_j    = final_norm(Block(z))                                one decoder layer of the target's
                                                                  architecture, its own KV cache
    logits  = head[d2t] @ f^_j                                    the target's output rows for a
                                                                  sub-vocabulary only

`f` here is what `Transformer.forward` returns as `hidden`: the target's *final-normed* hidden
state, i.e. exactly what its output head reads. (EAGLE uses the pre-norm state; the normed one is
what the runtime already hands out, and training and drafting both use it, so the head learns the
space it is asked to predict. Its own output goes through the target's final norm so that f^ lives
in that same space.) `f^_j` predicts x_{j+1}, and is fed back as the feature of the next step: the
head is autoregressive over its own features for k steps.

Sub-vocabulary. Gemma 3's output head has 262k rows; a draft step pays only for the `d2t` rows
(draft index -> target id, the most frequent ids of the training data, as in EAGLE-3 / FR-Spec).
Ids outside it get probability 0: the drafter never proposes them, and verification stays exact
because it only ever needs q of the proposed tokens and the residual max(0, p - q). The head
stores no copy of those rows: it gathers them from the target's `lm_head` at load time, and takes
the target's embedding and final norm by reference too. Its file holds the fc, the decoder layer
and `d2t` only.

Feature and cache bookkeeping (see `EagleDrafter`). Head entry j consumes (f_{j-1}, x_j) and sits
at rope position j, in cache slot j - 1. The engine hands over the target's true features of
every token its cache commits (`observe`); entries built from true features are kept across steps,
entries built from the head's own predictions (the draft steps) are rolled back after each
proposal, and rebuilt from true features once the target has scored those tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specdec.drafters.base import (FINAL_HIDDEN, DrafterBase, DrafterNeeds, Proposal, check_k, common_prefix_length,
                                   draft_chain, draft_rows)
from specdec.drafters.draft_model import DraftPool
from specdec.errors import InvalidRequestError
from specdec.models.kv_cache import KVCache
from specdec.models.quant import linear_rows
from specdec.models.transformer import Block, ModelConfig, Transformer, rope_tables, soft_cap
from specdec.sampling import SamplingParams, greedy_tokens, make_generator, process_logits, sample
from specdec.verify import TokenTree

FORMAT = "specdec-eagle"
FORMAT_VERSION = 1
CONFIG_FILE = "eagle.json"
WEIGHTS_FILE = "eagle.safetensors"
DEFAULT_HEAD_DIR = Path(__file__).parent / "eagle_default"
_INITIAL_ROOM = 256  # head cache slots beyond the prompt at `begin`; doubles when full


# -- a head's folder (the name `eagle` / `eagle:DIR` is parsed by `builder.parse`) --------------------


def check_head_folder(folder: Path | None) -> Path:
    """The folder of a saved head (None: the shipped default head); raises if it holds no head."""
    path = DEFAULT_HEAD_DIR if folder is None else Path(folder).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        where = "the shipped default head" if folder is None else repr(str(path))
        raise InvalidRequestError(
            f"no EAGLE head at {where}: a head folder holds {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(make one with `specdec train-draft --kind eagle --out DIR`)", "drafter")
    return path


# -- the head ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSpec:
    """What a saved head records besides its weights; the rest comes from the target's config."""

    hidden_size: int  # must equal the target's
    target_vocab_size: int  # must equal the target's
    intermediate_size: int  # the head's MLP width (the target's or smaller)
    draft_vocab_size: int  # len(d2t)
    target_num_layers: int  # for the error message when a head meets the wrong target
    rope_theta: float  # the head's one layer uses global attention with this base

    def block_config(self, target: ModelConfig) -> ModelConfig:
        """The target's config cut to one global-attention layer of the head's MLP width."""
        rope = dataclasses.replace(_global_rope(target), theta=self.rope_theta)
        return dataclasses.replace(target, num_layers=1, intermediate_size=self.intermediate_size,
                                   layer_rope=(rope,), layer_window=(None,), vocab_size=1)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None):
        return cls(target.hidden_size, target.vocab_size, intermediate_size or target.intermediate_size,
                   draft_vocab_size, target.num_layers, _global_rope(target).theta)


def _global_rope(target: ModelConfig):
    """The rope of the target's last global-attention layer (its last layer if all are local)."""
    ropes = [r for r, w in zip(target.layer_rope, target.layer_window) if w is None]
    return (ropes or list(target.layer_rope))[-1]


class EagleHead(nn.Module):
    """The trainable part: fc (2h -> h) and one decoder layer. Target pieces are passed in."""

    def __init__(self, block_cfg: ModelConfig):
        super().__init__()
        h = block_cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.block = Block(block_cfg)
        self.head_dim = block_cfg.head_dim
        self.register_buffer("inv_freq", block_cfg.layer_rope[0].inv_freq(block_cfg.head_dim).float(),
                             persistent=False)

    def forward(
        self,
        features: Tensor,  # [B, T, h] f_{j-1}: true target features or the head's own predictions
        embeds: Tensor,  # [B, T, h] scaled target embeddings of x_j
        positions: Tensor,  # [B, T] j
        cache: KVCache,  # one layer; the new entries go right after each row's length
        mask: Tensor | None = None,  # [B, T, T] bool among the new entries; None = causal
        visible: Tensor | None = None,  # [B, 1, T, S] bool over the first S slots: overrides the rule
    ) -> Tensor:  # [B, T, h] the layer's output, before the target's final norm
        b, t, _ = features.shape
        cache.check_room(t)
        start = cache.lengths  # [B]
        slots = start[:, None] + torch.arange(t, device=features.device)  # [B, T]
        cache.positions.scatter_(1, slots, positions)
        span = int(start.max()) + t
        if visible is None:
            # One global-attention layer: a query sees every committed slot before its row's
            # start, and the new entries per `mask` (causal by default; a tree mask for trees).
            rel = torch.arange(span, device=features.device)[None, None, :] - start[:, None, None]  # [B, 1, S]
            if mask is None:
                block_ok = rel <= torch.arange(t, device=features.device)[None, :, None]  # [B, T, S]
            else:
                block_ok = mask.gather(2, rel.clamp(0, t - 1).expand(-1, t, -1))
            visible = ((rel < 0) | ((rel < t) & block_ok))[:, None]  # [B, 1, T, S]
        cos, sin = rope_tables(positions, self.inv_freq)
        x = self.fc(torch.cat([features, embeds], dim=-1))
        x = self.block(x, cos, sin, cache, 0, slots, visible)
        cache.lengths += t
        return x


class EagleModel(nn.Module):
    """The head bound to its target: embedding, final norm and the sub-vocabulary's output rows.

    Only `head` is trainable and saved (with `d2t`); the target's pieces are references (the
    embedding, the norm) or a gathered copy of `d2t`'s rows of the output head.
    """

    def __init__(self, spec: HeadSpec, target: Transformer, d2t: Tensor, head: EagleHead | None = None):
        super().__init__()
        cfg = target.config
        if spec.hidden_size != cfg.hidden_size or spec.target_vocab_size != cfg.vocab_size:
            raise InvalidRequestError(
                f"this EAGLE head was trained for a target of hidden size {spec.hidden_size}, vocabulary "
                f"{spec.target_vocab_size} and {spec.target_num_layers} layers; the target has hidden size "
                f"{cfg.hidden_size}, vocabulary {cfg.vocab_size}: train one for it with `specdec train-draft`",
                "drafter")
        if d2t.dim() != 1 or len(d2t) != spec.draft_vocab_size or int(d2t.max()) >= cfg.vocab_size or int(d2t.min()) < 0:
            raise InvalidRequestError("the EAGLE head's d2t map does not fit its target's vocabulary", "drafter")
        self.spec = spec
        weight = target.embed_tokens.weight
        self.head = head if head is not None else EagleHead(spec.block_config(cfg))
        self.head.to(device=weight.device, dtype=weight.dtype)
        # References, not copies: the target's modules are frozen and shared.
        self._target = [target]  # a list so nn.Module does not register (and save) the target
        self.register_buffer("d2t", d2t.to(device=weight.device, dtype=torch.long), persistent=False)
        rows = linear_rows(target.lm_head, self.d2t).to(weight.dtype)  # works for an int8 target too
        self.register_buffer("head_rows", rows.clone(), persistent=False)
        self.embed_scale = cfg.embed_scale
        self.softcap = cfg.final_logit_softcap
        self.target_vocab_size = cfg.vocab_size

    @property
    def target(self) -> Transformer:
        return self._target[0]

    def embed(self, tokens: Tensor) -> Tensor:  # [B, T] -> [B, T, h], scaled like the target's input
        x = self.target.embed_tokens(tokens).detach()  # a module call: float or int8 tables alike
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def step(
        self,
        features: Tensor,  # [B, T, h] f_{j-1}
        tokens: Tensor,  # [B, T] x_j
        positions: Tensor,  # [B, T] j
        cache: KVCache,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One head pass -> (predicted features f^_j [B, T, h], sub-vocabulary logits [B, T, Vd] float32)."""
        x = self.head(features, self.embed(tokens), positions, cache, mask)
        feats = self.target.norm(x)
        return feats, self.logits(feats)

    def head_step(self, features: Tensor, tokens: Tensor, positions: Tensor, cache: KVCache,
                  visible: Tensor) -> tuple[Tensor, Tensor]:
        """`step` with an explicit visibility [B, 1, T, S] over the cache (token trees)."""
        x = self.head(features, self.embed(tokens), positions, cache, visible=visible)
        feats = self.target.norm(x)
        return feats, self.logits(feats)

    def logits(self, feats: Tensor) -> Tensor:  # [..., h] -> [..., Vd] float32
        return soft_cap((feats @ self.head_rows.T).float(), self.softcap)

    def to_target(self, sub: Tensor, fill: float) -> Tensor:
        """[..., Vd] -> [..., target vocab]: scatter into a row of `fill` (-inf logits, 0 probs)."""
        out = sub.new_full((*sub.shape[:-1], self.target_vocab_size), fill)
        return out.index_copy_(-1, self.d2t, sub)

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.head.block.self_attn
        p = self.head.fc.weight
        return KVCache(1, 1, cfg.kv_heads, cfg.head_dim, capacity, p.dtype, p.device)

    # -- files ------------------------------------------------------------------------------------

    def save(self, folder: str | Path, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write eagle.json + eagle.safetensors (the head's weights in `dtype`, and d2t)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.head.state_dict().items()}
        tensors["d2t"] = self.d2t.to("cpu", torch.int32).contiguous()
        save_file(tensors, str(folder / WEIGHTS_FILE))
        meta = {"format": FORMAT, "version": FORMAT_VERSION, **dataclasses.asdict(self.spec), **(extra or {})}
        (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")

    @classmethod
    def load(cls, folder: str | Path, target: Transformer) -> "EagleModel":
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            meta = json.loads((folder / CONFIG_FILE).read_text())
            tensors = load_file(str(folder / WEIGHTS_FILE))
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            raise InvalidRequestError(f"{folder}: not a readable EAGLE head ({exc})", "drafter") from exc
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise InvalidRequestError(f"{folder}: not a {FORMAT} v{FORMAT_VERSION} head", "drafter")
        spec = HeadSpec(**{f.name: meta[f.name] for f in dataclasses.fields(HeadSpec)})
        model = cls(spec, target, tensors.pop("d2t").long())
        weight = target.embed_tokens.weight
        state = {k: v.to(weight.dtype) for k, v in tensors.items()}
        try:
            model.head.load_state_dict(state)
        except RuntimeError as exc:
            raise InvalidRequestError(f"{folder}: head weights do not match its config ({exc})", "drafter") from exc
        return model.eval()


def frequent_ids(counts: Tensor, size: int, always: Sequence[int] = ()) -> Tensor:
    """d2t: the `size` most frequent ids of `counts` [vocab], plus `always` (e.g. EOS), sorted."""
    counts = counts.clone().double()
    for i in always:
        if 0 <= i < len(counts):
            counts[i] = math.inf
    size = min(size, len(counts))
    return counts.topk(size).indices.sort().values


# -- the drafter -----------------------------------------------------------------------------------


class EagleDrafter(DrafterBase):
    """Drafts k tokens with an `EagleModel`; implements the `Drafter` protocol plus `observe`.

    State per request: `_feats` [capacity, h] holds the target's true features of context[:n_feats]
    (appended by `observe` in commit order), `_tokens` the context those features and the cache
    entries belong to, and the head cache holds entries 1..cache_length built from true features
    only. See the module docstring for the indexing.
    """

    name = "eagle"
    # The target's final-normed features of every committed token; EAGLE-2 style trees.
    needs = DrafterNeeds(observes=(FINAL_HIDDEN,), trees=True, batches=True, model=True)
    draft_cost: float | None = None  # not measured: the policy's prior

    def __init__(self, model: EagleModel, draft_p_min: float = 0.0):
        self.model = model
        self.draft_p_min = float(draft_p_min)
        self._sampling = SamplingParams()
        self._generator: torch.Generator | None = None
        self._cache: KVCache | None = None
        self._feats: Tensor | None = None
        self._n_feats = 0
        self._tokens: list[int] = []
        self._pool: DraftPool | None = None  # shared by the spawned rows of a server (`reserve`)
        self._slot: int | None = None  # this request's row of the pool's head cache

    def spawn(self) -> "EagleDrafter":
        """Another request's drafter on the same head (its own features; its own head cache, or a
        row of the shared pool's once `reserve` made one)."""
        twin = type(self)(self.model, self.draft_p_min)
        twin._pool = self._pool
        return twin

    def reserve(self, rows: int, length: int) -> KVCache:
        """Rows spawned from here on share one head cache of `rows` rows x `length` slots, so that
        the rows of a batch draft in one head pass per draft position (`propose_batch`)."""
        pool = self._pool
        if pool is None or pool.cache.batch < rows or pool.cache.capacity < length:
            attn, weight = self.model.head.block.self_attn, self.model.head.fc.weight
            self._pool = pool = DraftPool(KVCache(1, rows, attn.kv_heads, attn.head_dim, length, weight.dtype,
                                                  weight.device))
        return pool.cache

    def batch_member(self) -> "EagleDrafter":
        return self

    def batch_key(self) -> object | None:
        return self._pool if self._slot is not None else None

    def propose_batch(self, drafters: list["EagleDrafter"], contexts: list[list[int]], ks: list[int]) -> list[Proposal]:
        return propose_batch(drafters, contexts, ks)

    @classmethod
    def load(cls, folder: str | Path, target: Transformer, draft_p_min: float = 0.0) -> "EagleDrafter":
        return cls(EagleModel.load(folder, target), draft_p_min)

    @property
    def device(self) -> torch.device:
        return self.model.head_rows.device

    @property
    def cache_length(self) -> int:
        return 0 if self._cache is None else self._cache.length()

    @property
    def num_features(self) -> int:
        return self._n_feats

    # -- protocol ---------------------------------------------------------------------------------

    def begin(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> None:
        self._sampling = sampling or SamplingParams()
        if generator is None and not self._sampling.greedy:
            generator = make_generator(self._sampling.seed, self.device)
        self._generator = generator
        room = len(prompt_ids) + _INITIAL_ROOM
        if self._pool is not None:
            if self._slot is None:
                self._slot, _ = self._pool.acquire()  # an EAGLE row starts empty: it reads hidden states
            self._cache = self._pool.cache.rows(self._slot + 1, self._slot)
            self._cache.truncate(0)
        else:
            self._cache = self.model.new_cache(room)
        self._feats = torch.zeros(room, self.model.spec.hidden_size, dtype=self.model.head_rows.dtype,
                                  device=self.device)
        self._n_feats = 0
        self._tokens = list(prompt_ids)

    @torch.inference_mode()
    def observe(self, hidden: Tensor) -> None:
        """The target's final-normed features of the tokens its cache just committed, in order.

        hidden: [T, h]
        """
        if self._feats is None:
            return
        need = self._n_feats + hidden.shape[0]
        if need > self._feats.shape[0]:
            grown = self._feats.new_zeros(max(need, 2 * self._feats.shape[0]), self._feats.shape[1])
            grown[: self._n_feats] = self._feats[: self._n_feats]
            self._feats = grown
        self._feats[self._n_feats : need] = hidden.to(self._feats.dtype)
        self._n_feats = need

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Proposal:
        check_k(k)
        k = min(k, self.model.target.config.max_position - len(context))
        root = self._sync(context, max(k, 1))
        if root is None or k <= 0:
            return Proposal([])
        n = len(context)
        feat, logits = root
        committed = self._cache.length()  # == n - 1: what to roll back to after drafting
        state = [feat]

        def advance(token: int, i: int) -> Tensor:
            # Autoregressive over its own features: entry n + i consumes (f^, draft token i).
            pos = torch.tensor([[n + i]], device=self.device)
            state[0], out = self.model.step(state[0], torch.tensor([[token]], device=self.device), pos, self._cache)
            return out[0, -1]

        proposal = draft_chain(self._choose, advance, logits, k)
        # Draft entries were built from predicted features: drop them; the target's features of
        # the accepted ones arrive through `observe` and rebuild them next time.
        self._cache.truncate(committed)
        return proposal

    @torch.inference_mode()
    def propose_tree(self, context: list[int], depth: int = 5, top_k: int = 4, budget: int = 24) -> TokenTree:
        """An EAGLE-2 style draft tree of at most `budget` nodes and `depth` levels.

        Each level expands the `top_k` most likely frontier nodes (by cumulative draft
        log-probability, the head's estimate of the chance the whole path is accepted), each
        with its `top_k` best children, all in one head pass with a tree mask; finally the
        `budget` most likely nodes are kept (a node's score never exceeds its parent's, so the
        kept set hangs together). Candidates are deterministic, so the tree carries no q: tree
        verification treats them as one-hot (exact, see `verify.verify_tree_sampling`).
        Returns an empty tree when there is nothing to draft from.
        """
        n = len(context)
        depth = min(depth, self.model.target.config.max_position - n)
        root = self._sync(context, depth * top_k)
        if root is None or depth <= 0 or budget <= 0:
            return TokenTree([], [])
        committed = self._cache.length()
        root_feat, root_logits = root  # [1, 1, h], [Vd]
        # Per node: token (target id), parent, cumulative log-prob, its parent's output feature,
        # and once expanded its cache slot.
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        feat_in: list[Tensor] = []
        slot: dict[int, int] = {}

        def add_children(parent: int, logits: Tensor, base: float, feat: Tensor) -> list[int]:
            top = logits.log_softmax(-1).topk(min(top_k, logits.shape[-1]))
            out = []
            for lp, i in zip(top.values.tolist(), top.indices.tolist()):
                tokens.append(int(self.model.d2t[i]))
                parents.append(parent)
                scores.append(base + lp)
                feat_in.append(feat)
                out.append(len(tokens) - 1)
            return out

        frontier = add_children(-1, root_logits, 0.0, root_feat[0, 0])
        for d in range(2, depth + 1):
            expand = sorted(frontier, key=lambda i: -scores[i])[:top_k]
            start = self._cache.length()
            # Node i's entry sits at position n - 1 + depth(i) and sees the committed entries,
            # its expanded ancestors' entries and itself.
            span = start + len(expand)
            visible = torch.zeros(1, 1, len(expand), span, dtype=torch.bool, device=self.device)
            visible[..., :committed] = True
            for row, i in enumerate(expand):
                slot[i] = start + row
                a = i
                while a >= 0:
                    visible[0, 0, row, slot[a]] = True
                    a = parents[a]
            feats, logits = self.model.head_step(
                torch.stack([feat_in[i] for i in expand])[None],
                torch.tensor([[tokens[i] for i in expand]], device=self.device),
                torch.full((1, len(expand)), n - 2 + d, device=self.device), self._cache, visible)
            frontier = []
            for row, i in enumerate(expand):
                frontier += add_children(i, logits[0, row], scores[i], feats[0, row])
        self._cache.truncate(committed)
        keep = sorted(sorted(range(len(tokens)), key=lambda i: -scores[i])[:budget])
        for i in keep:  # ties can break the nesting: keep every kept node's ancestors too
            a = parents[i]
            while a >= 0 and a not in keep:
                keep.append(a)
                a = parents[a]
        keep = sorted(set(keep))  # parents were created before their children
        index = {old: new for new, old in enumerate(keep)}
        return TokenTree([tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep])

    def _sync(self, context: list[int], room: int) -> tuple[Tensor, Tensor] | None:
        """Rebuild the head's cache for `context` from true features; return the root step's
        (predicted feature f^_{n-1} [1, 1, h], sub-vocabulary logits [Vd]) or None (no features)."""
        if self._cache is None:
            self.begin(list(context))
        n = len(context)
        # Features and cache entries belong to `_tokens`; whatever of it `context` no longer
        # agrees with is stale (a caller rolling back), the rest is kept.
        # (Features observed since the last call extend `_tokens`: they belong to the tokens that
        # `context` adds, in order, which is how the engine calls `observe`.)
        valid = common_prefix_length(self._tokens, context)
        if valid < len(self._tokens):
            self._n_feats = min(self._n_feats, valid)
        self._tokens = list(context)
        if n < 2 or self._n_feats < n - 1:
            # The head needs f_{n-2}: without the target's features of the context (a caller that
            # does not `observe`) there is nothing to draft from; the engine does a plain step.
            return None
        # Entries 1..keep are built from true features and tokens still in the context; at least
        # entry n - 1 is (re)built, since its output predicts x_n.
        keep = min(self.cache_length, self._n_feats, valid - 1, n - 2)
        self._cache.truncate(keep)
        self._ensure_room(n - 1 - keep + room)
        # Build entries keep+1 .. n-1 from true features in one pass; the last one predicts x_n.
        idx = torch.arange(keep + 1, n, device=self.device)
        feats, logits = self.model.step(self._feats[idx - 1][None], torch.tensor([context[keep + 1:]],
                                        device=self.device), idx[None], self._cache)
        return feats[:, -1:], logits[0, -1]

    def _choose(self, logits: Tensor) -> tuple[int | None, Tensor | None]:
        """One draft position from sub-vocabulary logits [Vd]: (target id, q row [target vocab]).

        Sampling: q is `process_logits` of the logits with the request's params, where ids outside
        the sub-vocabulary have logit -inf. Processing the Vd finite logits and scattering the
        result into zeros is the same thing (an -inf logit gets probability 0 at every stage and
        never changes a top-k / top-p / min-p threshold of the finite ones), and far cheaper
        where the target's vocabulary is many times the sub-vocabulary.
        """
        if self._sampling.greedy:
            if self.draft_p_min > 0 and float(logits.softmax(-1).max()) < self.draft_p_min:
                return None, None
            return int(self.model.d2t[greedy_tokens(logits[None])[0]]), None
        q_sub = process_logits(logits, self._sampling)  # [Vd]
        if self.draft_p_min > 0 and float(q_sub.max()) < self.draft_p_min:
            return None, None
        i = int(sample(q_sub, self._generator))
        return int(self.model.d2t[i]), self.model.to_target(q_sub, 0.0)

    def feedback(self, num_accepted: int) -> None:
        # Nothing to do: accepted tokens' features arrive through `observe`, and `propose`
        # rebuilds their entries.
        pass

    def end(self, output_ids: list[int]) -> None:
        if self._slot is not None:
            self._pool.release(self._slot)
            self._slot = None
        self._cache = None
        self._feats = None
        self._n_feats = 0
        self._tokens = []
        self._generator = None

    def _ensure_room(self, new: int) -> None:
        cache = self._cache
        n = cache.length()
        if n + new <= cache.capacity or self._slot is not None:  # a pool row is sized for any request
            return
        grown = self.model.new_cache(max(n + new, 2 * cache.capacity))
        grown.keys[0][:, :, :n] = cache.keys[0][:, :, :n]
        grown.values[0][:, :, :n] = cache.values[0][:, :, :n]
        grown.positions[:, :n] = cache.positions[:, :n]
        grown.truncate(n)
        self._cache = grown


_BATCHED_CATCH_UP = 4  # head entries a row rebuilds inside a batched pass, at most


@torch.inference_mode()
def propose_batch(drafters: list[EagleDrafter], contexts: list[list[int]], ks: list[int]) -> list[Proposal]:
    """Each drafter's `propose(context, k)`, for rows of one pool, in one head pass per draft
    position (plus one to rebuild each row's entries from the target's new features).

    Every row keeps its own features, sampling and generator, and the bookkeeping of `propose`:
    entries built from predicted features are rolled back afterwards. A pass runs over the pool
    rows [lo, hi) that hold the batch; rows in that range that are not drafting get padding, and
    their lengths are put back after.
    """
    slots = [d._slot for d in drafters]
    lo, hi = min(slots), max(slots) + 1
    view = drafters[0]._pool.cache.rows(hi, lo)

    def step(feeds: dict[int, tuple[Tensor, list[int], list[int]]]) -> dict[int, tuple[Tensor, Tensor]]:
        return _batched_pass(drafters[0], view, slots, lo, hi, feeds)

    roots, feeds, committed = _batched_catch_up(drafters, contexts, ks)
    if feeds:
        roots.update(step(feeds))
    state = {i: feat for i, (feat, _) in roots.items()}
    drafted = {i: 0 for i in roots}

    def advance(feed: dict[int, int]) -> dict[int, Tensor]:
        # Autoregressive over its own features: entry n + j consumes (f^, draft token j).
        for i in feed:
            drafted[i] += 1
        logits = {}
        for i, (feat, lg) in step({i: (state[i][0], [t], [len(contexts[i]) + drafted[i] - 1])
                                   for i, t in feed.items()}).items():
            state[i], logits[i] = feat, lg
        return logits

    proposals = draft_rows(drafters, {i: lg for i, (_, lg) in roots.items()}, ks, advance)
    for i in committed:
        # Draft entries were built from predicted features: drop them (see `propose`).
        drafters[i]._cache.truncate(committed[i])
    return proposals


def _batched_catch_up(drafters: list[EagleDrafter], contexts: list[list[int]], ks: list[int]):
    """Bring each row's head entries up to its context (`ks` capped in place by the room left):
    a long rebuild (a new request) runs on the row's own through `_sync`, and its root goes into
    `roots`; a short one becomes a feed (features, tokens, positions) for the shared pass. Returns
    (roots, feeds, committed): by drafter index, the root (feature, logits), the feed, and the head
    cache length to roll back to after drafting."""
    model = drafters[0].model
    roots: dict[int, tuple[Tensor, Tensor]] = {}
    feeds = {}
    committed = {}
    for i, (d, context, k) in enumerate(zip(drafters, contexts, ks)):
        check_k(k)
        k = ks[i] = min(k, model.target.config.max_position - len(context))
        if k <= 0:
            continue
        n = len(context)
        valid = common_prefix_length(d._tokens, context)
        if n - 1 - min(d.cache_length, d._n_feats, valid - 1, n - 2) > _BATCHED_CATCH_UP:
            root = d._sync(context, k)  # a long rebuild (a new request) on the row's own
            if root is not None:
                roots[i] = root
                committed[i] = d._cache.length()
            continue
        # As `_sync`, with the pass itself shared by the rows.
        if valid < len(d._tokens):
            d._n_feats = min(d._n_feats, valid)
        d._tokens = list(context)
        if n < 2 or d._n_feats < n - 1:
            continue
        keep = min(d.cache_length, d._n_feats, valid - 1, n - 2)
        d._cache.truncate(keep)
        feeds[i] = (d._feats[keep : n - 1], list(context[keep + 1 :]), list(range(keep + 1, n)))
        committed[i] = n - 1
    return roots, feeds, committed


def _batched_pass(first: EagleDrafter, view, slots: list[int], lo: int, hi: int,
                  feeds: dict[int, tuple[Tensor, list[int], list[int]]]) -> dict[int, tuple[Tensor, Tensor]]:
    """One head pass over the pool rows [lo, hi) (`view`), each fed row at its own length. feeds:
    drafter index -> (features [T_i, h], tokens, positions); returns per fed row (the predicted
    feature of its last entry [1, 1, h], its logits [Vd]). Rows not fed keep their lengths."""
    model, device = first.model, first.device
    h = model.spec.hidden_size
    lengths = view.lengths.clone()
    width = max(len(t) for _, t, _ in feeds.values())
    feats = torch.zeros(hi - lo, width, h, dtype=model.head_rows.dtype, device=device)
    tokens = torch.zeros(hi - lo, width, dtype=torch.long, device=device)
    positions = lengths[:, None] + torch.arange(width, device=device)[None]  # [rows, T]
    for i, (f, toks, pos) in feeds.items():
        r, t = slots[i] - lo, len(toks)
        feats[r, :t] = f
        tokens[r, :t] = torch.tensor(toks, device=device)
        positions[r, :t] = torch.tensor(pos, device=device)
        if t < width:  # padding after the real entries: causally invisible to them
            positions[r, t:] = pos[-1] + 1 + torch.arange(width - t, device=device)
    out_feats, logits = model.step(feats, tokens, positions, view)  # [rows, T, h], [rows, T, Vd]
    view.lengths.copy_(lengths)
    out = {}
    for i, (_, toks, _) in feeds.items():
        r, t = slots[i] - lo, len(toks)
        view.lengths[r] += t
        out[i] = (out_feats[r : r + 1, t - 1 : t], logits[r, t - 1])
    return out
