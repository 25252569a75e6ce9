"""The builder's drafter registry: one parser of drafter names, one clear error for an unknown one,
and every registered kind builds a drafter whose declared capabilities (`DrafterNeeds`) are the
registry's and are kept (each declared capability's methods are there; a plain drafter has none it
does not declare)."""

import pytest
import torch

from specdec import Engine, builder
from specdec.drafters import NgramDrafter
from specdec.drafters.base import CAPABILITIES, Drafter, DrafterNeeds, Spawner, declared, missing_capabilities
from specdec.drafters.combined import LookupFirstDrafter
from specdec.errors import InvalidRequestError
from specdec.settings import DEFAULT_NUM_SPECULATIVE_TOKENS, DecodingSettings

from test_eagle import random_head

pytestmark = pytest.mark.fast


def test_an_unknown_drafter_is_one_error_naming_the_known_ones():
    with pytest.raises(InvalidRequestError, match="unknown drafter 'nope'") as caught:
        builder.parse("nope")
    message = str(caught.value)
    assert caught.value.param == "drafter" and "\n" not in message
    for known in ("none", "ngram", "suffix", "eagle", "ngram+LEARNED", "model preset", "path of a draft model"):
        assert known in message
    # Engine.load says the same, before it loads anything (the default model is not read).
    with pytest.raises(InvalidRequestError, match="unknown drafter 'nope'; choose none, ngram"):
        Engine.load("default", drafter="nope")


def test_settings_carry_every_default_once():
    s = DecodingSettings()
    assert (s.target, s.drafter, s.quantize, s.num_speculative_tokens) == ("default", "auto", "auto",
                                                                           DEFAULT_NUM_SPECULATIVE_TOKENS)
    resolved = builder.resolve(DecodingSettings(target="/models/x.gguf", drafter="auto", quantize="none"))
    assert (resolved.drafter, resolved.quantize, resolved.device) == ("ngram", "none", "cpu")
    with pytest.raises(InvalidRequestError, match="unknown dtype"):
        DecodingSettings(dtype="float8")


@pytest.fixture(scope="module")
def names(tiny_models, tmp_path_factory):
    """A drafter name of every registered kind (and the combinations) for the tiny gemma3 target."""
    target = tiny_models["gemma3"]["target"]
    head = tmp_path_factory.mktemp("head") / "h"
    random_head(target, 70, seed=3).save(head, dtype=torch.float32)
    draft = str(tiny_models["gemma3"]["folder"])  # the target itself as its draft model
    return ["none", "ngram", "suffix", f"eagle:{head}", draft, f"ngram+eagle:{head}", f"suffix+{draft}"]


def test_every_registered_kind_builds_and_keeps_its_declared_capabilities(tiny_models, names):
    target = tiny_models["gemma3"]["target"]
    made = builder.Made(target, None, DecodingSettings(quantize="none"))
    kinds = set()
    for name in names:
        spec = builder.parse(name)
        kinds.add(spec.kind)
        drafter = builder.make_drafter(spec, made)
        if spec.kind == "none":
            assert drafter is None and builder.needs_of(spec) is None
            continue
        assert isinstance(drafter, Drafter) and isinstance(drafter, Spawner), name
        # What the registry says before anything loads is what the made drafter declares.
        assert drafter.needs == builder.needs_of(spec), name
        assert missing_capabilities(drafter) == [], name
        if not isinstance(drafter, LookupFirstDrafter):  # a combination forwards to its parts
            undeclared = set(CAPABILITIES) - declared(drafter.needs)
            assert not [flag for flag in undeclared if isinstance(drafter, CAPABILITIES[flag])], name
        assert builder.needs_of(builder.parse(name)).trees == drafter.needs.trees
    assert kinds == set(builder.REGISTRY)  # every registered kind was built


def test_a_broken_declaration_is_seen():
    class Liar(NgramDrafter):
        needs = DrafterNeeds(trees=True, batches=True)

    assert missing_capabilities(Liar()) == ["batches"]


def test_serving_drafters_come_from_the_registry(tiny_models, names):
    target = tiny_models["gemma3"]["target"]
    made = builder.Made(target, None, DecodingSettings(quantize="none"))
    drafters, default = builder.serving_drafters(names[-1], made)  # suffix+DRAFT
    assert default == "suffix+draft_model"
    assert set(drafters) == {"none", "ngram", "suffix", "draft_model", "ngram+draft_model", "suffix+draft_model"}
    assert drafters["ngram+draft_model"].learned is drafters["draft_model"]  # loaded once
    with pytest.raises(InvalidRequestError, match="after ngram\\+ comes a learned drafter"):
        builder.serving_drafters("ngram+suffix", made)
