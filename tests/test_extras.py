"""A plain `pip install specdec` (no extras) runs the library and `specdec generate`; a feature whose
extra is missing says in one line which extra to install.

A missing module is simulated the way Python itself marks one: `sys.modules[name] = None` makes
both `import name` and `importlib.util.find_spec(name)` report it absent.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import Engine
from specdec.cli import main

from helpers import make_tiny_hf

SRC = str(Path(__file__).resolve().parents[1] / "src")
# What the extras add on top of the library (httpx stays: transformers' hub client needs it anyway).
EXTRA_MODULES = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "matplotlib", "ray",
                 "llguidance")


def test_generate_runs_without_any_extra(tmp_path):
    folder, _ = make_tiny_hf(tmp_path, "llama")
    script = (
        "import json, sys\n"
        f"for name in {EXTRA_MODULES!r}:\n"
        "    sys.modules[name] = None\n"
        "from specdec.cli import main\n"
        f"code = main(['generate', '--model', {str(folder)!r}, '--prompt-ids', '5,6,7,5,6', '--max-tokens', '4',"
        " '--drafter', 'ngram', '--json'])\n"
        f"leaked = [m for m in {EXTRA_MODULES!r} if sys.modules.get(m) is not None]\n"
        "print(json.dumps(leaked))\n"
        "sys.exit(code)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                              "HOME": str(Path.home())})
    assert out.returncode == 0, out.stderr[-2000:]
    result, leaked = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert leaked == []
    # The same tokens as the library with every extra installed gives (greedy, lossless).
    same = Engine.load(str(folder), drafter="ngram").generate(prompt_ids=[5, 6, 7, 5, 6], max_new_tokens=4)
    assert result["token_ids"] == same.token_ids and len(same.token_ids) >= 1


@pytest.mark.parametrize("argv,extra,module", [
    (["serve", "--port", "0"], "server", "fastapi"),
    (["serve", "--port", "0"], "server", "prometheus_client"),
])
def test_serve_without_the_server_extra_says_what_to_install(monkeypatch, capsys, argv, extra, module):
    monkeypatch.setitem(sys.modules, module, None)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert module in err and f"pip install 'specdec[{extra}]'" in err


def test_bench_plot_without_the_bench_extra_says_so_before_the_run(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # A model that does not exist: the plot's check must come first, before any load or run.
    code = main(["bench", "--model", str(tmp_path / "absent"), "--configs", "plain", "--tasks", "code",
                 "--per-group", "1", "--plot", str(tmp_path / "p.png")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "matplotlib" in err and "pip install 'specdec[bench]'" in err
    assert not (tmp_path / "p.png").exists()
