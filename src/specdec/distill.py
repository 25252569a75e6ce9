"""The data of self-distillation (`specdec train-draft`, steps 1-3 of the recipe in `train.py`):
seed texts from what this machine already holds (`local_texts`, `build_seeds`), the target's
greedy continuations of them with its features at every position (`generate_data`), its reading
of the local texts (`text_data`), and the sub-vocabulary the data asks for (`choose_d2t`).
"""

from __future__ import annotations

import ast
import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


# -- seeds ---------------------------------------------------------------------------------------

TOPICS = ["the ocean", "volcanoes", "baking bread", "friendship", "the moon", "a rainy day", "bicycles",
          "electric cars", "honey bees", "the printing press", "learning a language", "chess", "coffee",
          "mountains", "a lighthouse", "winter", "recycling", "libraries", "the internet", "trains",
          "gardening", "a lost key", "robots", "music", "the desert", "birds", "old maps", "a city at night",
          "teamwork", "sleep", "running", "clouds", "ancient Rome", "photosynthesis", "magnets", "rivers"]
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps", "coins"]


@functools.cache
def local_texts(limit_files: int = 4000) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(function name, docstring) pairs from the standard library and prose paragraphs from
    installed packages' docs, in a deterministic order. Cached: a scan parses a few thousand files
    and seeds, text data and the sub-vocabulary all read it."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    funcs: list[tuple[str, str]] = []
    paras: list[str] = []
    files = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "idlelib" not in p.parts)
    for path in files[:limit_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if not doc or len(doc) < 60:
                    continue
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    funcs.append((f"{path.stem}.{node.name}", doc))
                paras += [p.strip() for p in doc.split("\n\n") if _prose(p.strip(), 120)]
    site = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(site.glob("*.dist-info/METADATA"))[:300] + sorted(site.rglob("README*"))[:100]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for p in text.split("\n\n"):
            if _prose(p.strip(), 200):
                paras.append(p.strip())
    return tuple(funcs), tuple(paras)


def local_pieces() -> list[str]:
    """Every local text as one list: the prose paragraphs, then the functions' docstrings."""
    funcs, paras = local_texts()
    return [*paras, *(doc for _, doc in funcs)]


def _prose(p: str, min_len: int) -> bool:
    """Long, mostly letters and spaces, not a header block or a code listing."""
    return len(p) >= min_len and ":" not in p[:30] and sum(c.isalpha() or c == " " for c in p) > 0.85 * len(p)


def build_seeds(n: int, rng: random.Random) -> list[str]:
    """`n` seed texts: a mix of plain continuations and Question/Answer prompts."""
    funcs, paras = local_texts()
    if not paras:
        paras = [f"This is a short note about {t}." for t in TOPICS]
    seeds = []
    for i in range(n):
        kind = i % 9
        para = rng.choice(paras)[:700]
        if kind == 0:
            seeds.append(para[: rng.randint(80, 400)])
        elif kind == 1 and funcs:
            name, _ = rng.choice(funcs)
            seeds.append(f"Question: What does the Python function `{name}` do?\nAnswer:")
        elif kind == 2 and funcs:
            _, doc = rng.choice(funcs)
            line = doc.strip().split("\n")[0].rstrip(".")
            seeds.append(f"Question: Write a Python function that does the following: {line}.\nAnswer:")
        elif kind == 3:
            seeds.append(f"Question: Summarize the following text in one or two sentences.\n\n{para}\nAnswer:")
        elif kind == 4:
            seeds.append(f"Question: Explain in simple words what this means: {para.split('. ')[0]}.\nAnswer:")
        elif kind == 5:
            who, what = rng.choice(NAMES), rng.choice(ITEMS)
            a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(1, 20)
            seeds.append(f"Question: {who} has {a} {what}. {who} buys {b} more and then gives {c} to a friend. "
                         f"How many {what} does {who} have now?\nAnswer:")
        elif kind == 6:
            t1, t2 = rng.sample(TOPICS, 2)
            form = rng.choice(["Write a short story about {a}.", "Give three facts about {a}.",
                               "What is the difference between {a} and {b}?", "Write a poem about {a} and {b}.",
                               "Describe {a} to a child.", "Write an email to a friend about {a}."])
            seeds.append(f"Question: {form.format(a=t1, b=t2)}\nAnswer:")
        elif kind == 7:
            seeds.append(f"{para}\n\nQuestion: What is the main point of the text above?\nAnswer:")
        else:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            seeds.append(f"Question: What is {a} times {b}? Explain step by step.\nAnswer:")
    return seeds


# -- distillation data ---------------------------------------------------------------------------


@dataclass
class DistillData:
    tokens: list[Tensor]  # per sequence [L] long
    features: list[Tensor]  # per sequence [L, h] float32: target's final-normed hidden states
    # per sequence [L] long: the target's argmax after each position; [0] (not computed) for
    # teacher-forced text, where the 262k-row head would cost more than all the layers together
    greedy: list[Tensor]


@torch.inference_mode()
def text_data(target, tokenizer, positions: int, window: int, rng: random.Random, progress=None) -> DistillData:
    """Teacher-forced local text: the target reads windows of up to `window` tokens of the local
    texts (`local_texts`, shuffled with `rng`, paragraphs packed into a window until it is full)
    and every position's feature is kept, up to `positions` positions in all.

    EAGLE trains on a fixed corpus's features; this is that, from what the machine holds. It costs
    only the target's layers (no output head, no decoding loop), several times more positions per
    second than batched greedy generation, so it buys the head far more varied contexts per minute.
    (On the default model it did not raise the head's accuracy on new questions; docs/archive/BENCHMARKS-history.md.)
    """
    pieces = local_pieces()
    rng.shuffle(pieces)
    bos = [target.config.bos_token_id] if target.config.bos_token_id is not None else []
    device = target.embed_tokens.weight.device
    out = DistillData([], [], [])
    done = 0

    def flush(ids: list[int]) -> None:
        nonlocal done
        ids = ids[: max(2, min(window, positions - done))]
        _, hidden = target(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None],
                           target.new_cache(1, len(ids)), last_n=0)
        out.tokens.append(torch.tensor(ids))
        out.features.append(hidden[0].float().cpu())
        out.greedy.append(torch.zeros(0, dtype=torch.long))
        done += len(ids)
        if progress:
            progress(min(done, positions), positions)

    separator = [i for i in tokenizer.encode("\n\n") if i not in bos]
    ids: list[int] = []
    for piece in pieces:
        if done >= positions:
            break
        enc = [i for i in tokenizer.encode(piece) if i not in bos]
        ids = (ids + separator if ids else list(bos)) + enc
        if len(ids) >= window:
            flush(ids)
            ids = []
    if ids and done < positions and len(ids) > 1:
        flush(ids)
    return out


@torch.inference_mode()
def generate_data(target, seed_ids: list[list[int]], gen_tokens: int, batch: int, progress=None) -> DistillData:
    """Greedy continuations of every seed, with the target's features at every position.

    Each batch prefills its rows one by one (different lengths, batch 1 is the efficient shape for
    a long prefill anyway), copies each row's keys and values into one batched cache, then decodes
    all rows together, each at its own position (the runtime keeps one length per row).
    """
    out = DistillData([], [], [])
    eos = set(target.config.eos_token_ids)
    device = target.embed_tokens.weight.device
    for start in range(0, len(seed_ids), batch):
        rows = seed_ids[start : start + batch]
        b = len(rows)
        cache = target.new_cache(b, max(map(len, rows)) + gen_tokens)
        toks, feats, greedy = [], [], []
        nxt = torch.zeros(b, 1, dtype=torch.long, device=device)
        for r, ids in enumerate(rows):
            one = target.new_cache(1, len(ids))
            logits, hidden = target(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None], one)
            n = len(ids)
            for store, src in ((cache.keys, one.keys), (cache.values, one.values)):
                for layer_dst, layer_src in zip(store, src):
                    layer_dst[r, :, :n] = layer_src[0, :, :n]
            cache.positions[r, :n] = one.positions[0, :n]
            cache.lengths[r] = n
            toks.append(list(ids))
            feats.append([hidden[0].cpu()])
            greedy.append(logits[0].argmax(-1).tolist())
            nxt[r, 0] = greedy[r][-1]
        for _ in range(gen_tokens - 1):
            positions = cache.lengths[:, None].clone()
            logits, hidden = target(nxt, positions, cache)
            best = logits[:, -1].argmax(-1)  # [b]
            best_list, nxt_list = best.tolist(), nxt[:, 0].tolist()
            hidden = hidden.cpu()  # one copy a step, not one per row (on a GPU each is a sync)
            for r in range(b):
                toks[r].append(nxt_list[r])
                feats[r].append(hidden[r])
                greedy[r].append(best_list[r])
            nxt = best[:, None]
        for r in range(b):
            t = torch.tensor(toks[r])
            f = torch.cat(feats[r]).float().clone()
            g = torch.tensor(greedy[r])
            # Cut after the first generated EOS: what follows is not text the target would write.
            hits = [i for i in range(len(rows[r]), len(t)) if int(t[i]) in eos]
            end = hits[0] + 1 if hits else len(t)
            out.tokens.append(t[:end])
            out.features.append(f[:end])
            out.greedy.append(g[:end])
        if progress:
            progress(min(start + batch, len(seed_ids)), len(seed_ids))
    return out


def choose_d2t(data: DistillData, vocab: int, size: int, always: tuple[int, ...], tokenizer=None) -> Tensor:
    """The sub-vocabulary: every id the target chose in the data, most frequent first; the rest
    of the `size` slots go to the ids most frequent in the local texts (greedy text is narrow:
    ~2k distinct ids in 58k positions for Gemma 3 270M, while held-out text needs more)."""
    from .drafters.eagle import frequent_ids

    chosen = torch.zeros(vocab, dtype=torch.float64)
    for g in data.greedy:
        chosen.index_add_(0, g, torch.ones(len(g), dtype=torch.float64))
    text = torch.zeros(vocab, dtype=torch.float64)
    if tokenizer is not None:
        for piece in local_pieces():
            ids = torch.tensor([i for i in tokenizer.encode(piece) if 0 <= i < vocab], dtype=torch.long)
            text.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
    # Any id the target chose outranks every id seen only in text.
    return frequent_ids(chosen + text / (float(text.max()) + 1.0), size, always)
