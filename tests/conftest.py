import pytest
import torch

from helpers import make_char_tokenizer, make_tiny_hf


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """family -> dict(target, folder): tiny random llama and gemma3 (sliding window) models, fp32."""
    from specdec.models import loader

    out = {}
    for family in ("llama", "gemma3"):
        folder, _ = make_tiny_hf(tmp_path_factory.mktemp(family), family, seed=0)
        target, _ = loader.load(folder, torch.float32, "cpu")
        out[family] = dict(target=target, folder=folder)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny random llama (seed 0, fp32) of the draft-model tests, as a target and a draft base."""
    from specdec.models import loader

    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("v"), "llama", seed=0)
    model, _ = loader.load(folder, torch.float32, "cpu")
    return model


@pytest.fixture(scope="session")
def default_engine_fp32():
    from specdec import Engine

    return Engine.load(target="default", drafter="none", dtype="float32", quantize="none")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are all per-call overhead: on a shared 2-core machine two threads fight each
    other and run ~10x slower than one. Modules of tiny-model tests opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Gemma 3 with the character tokenizer: what the server tests serve."""
    folder, _ = make_tiny_hf(tmp_path_factory.mktemp("srv"), "gemma3")
    make_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def engine(tiny_folder):
    from specdec import Engine

    return Engine.load(str(tiny_folder), drafter="none", dtype="float32")  # plain: the reference "run alone"
