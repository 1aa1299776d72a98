"""The plan's vocabulary: labels and users as types that render (and sort as) the text they replace, and
refusals whose cause, not their wording, decides what gets planned."""
from __future__ import annotations

import copy
import json
import pickle

import pytest
from torch import nn

from normswap.surgery.labels import Cause, Label, Refusal, User
from normswap.surgery.plan import NormPlan, Plan, keepable
from normswap.surgery.walk import NormSite


def test_a_label_is_its_text_and_its_fields():
    w = Label("param", "experts.w", -2)
    assert (w.kind, w.name, w.axis, w.ref) == ("param", "experts.w", -2, "experts.w#-2")
    assert w == "param:experts.w#-2" and hash(w) == hash("param:experts.w#-2") and w.of("scale") == "scale:experts.w#-2"
    labels = [Label("param", "b"), Label("layer", "z"), Label("norm", "a"), Label("entry", "m"), Label("layer", "a")]
    assert sorted(labels) == sorted(map(str, labels))   # step order is the order of the old strings
    assert json.dumps([Label("layer", "fc")]) == '["layer:fc"]'
    for again in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
        assert (type(again), again, again.axis) == (Label, w, -2)
    with pytest.raises(AttributeError):
        w.kind = "layer"
    with pytest.raises(ValueError):
        Label("user", "x")


def test_a_user_renders_the_old_text_and_sorts_by_it():
    users = [User("module", "h.0.fc", "Linear"), User("operation", "gelu", where="h.0"), User("operation", "tanh"),
             User("attention", where="enc.attn"), User("output"), User("output", "hidden_states.2"),
             User("reader", "lm_head")]
    texts = ["h.0.fc (Linear)", "operation 'gelu' in h.0", "operation 'tanh'", "nn.MultiheadAttention in enc.attn",
             "the model output", "the model output 'hidden_states.2'", "lm_head"]
    assert [str(u) for u in users] == texts
    assert [str(u) for u in sorted(users)] == sorted(texts)
    assert [u.nested for u in users] == [None] * 5 + ["hidden_states.2", None]


def _plan(**reasons) -> tuple[Plan, list[NormSite]]:
    sites = [NormSite(n, nn.LayerNorm(4)) for n in ("a", "b", "c")]
    return Plan({n: NormPlan(n, 4, reason=reasons.get(n)) for n in ("a", "b", "c")}, []), sites


def test_the_cause_of_a_refusal_decides_not_its_wording():
    """A post-LN refusal is the one the plan gives, whatever either refusal says (a refusal that merely mentions
    post-LN is an ordinary one); a parameter that never ran concerns every norm: no norm is kept back."""
    post_ln = Refusal(Cause.POST_LN, "b feeds the stream and is read too", ("b",))
    worded = Refusal(Cause.READ, "a is read by post-LN.proj", ("a",))
    p, sites = _plan(a=worded, b=post_ln)
    assert p.reason == "b feeds the stream and is read too" and p.refusal is post_ln
    assert type(p.reason) is str and keepable(p, sites) == {"a": worded, "b": post_ln}
    p, sites = _plan(a=worded)
    assert p.reason == "a is read by post-LN.proj" and keepable(p, sites) == {"a": worded}
    assert keepable(p, sites)["a"].cause is Cause.READ
    p.reasons.append(Refusal(Cause.UNRUN, "x did not run", ("x",)))   # model-wide: nothing kept back
    assert keepable(p, sites) == {} and p.reason == "a is read by post-LN.proj"
    p, sites = _plan()
    p.norms["c"].sources = [Label("norm", "a")]   # c reads a kept norm's output: c stays too
    assert {n: r.cause for n, r in keepable(p, sites, {"a"}).items()} == {"c": Cause.PINNED}
    assert _plan()[0].reason is None and _plan()[0].refusal is None


def test_a_refusal_is_its_message():
    r = Refusal(Cause.UNCENTRABLE, "conv (Conv1d) writes the input of ln", ("conv", "ln"))
    assert f"no exact conversion: {r}" == "no exact conversion: conv (Conv1d) writes the input of ln"
    assert json.dumps({"reason": r}) == '{"reason": "conv (Conv1d) writes the input of ln"}'
    assert (r.cause, r.modules) == (Cause.UNCENTRABLE, ("conv", "ln"))
    assert copy.deepcopy(r).cause is Cause.UNCENTRABLE and pickle.loads(pickle.dumps(r)).modules == ("conv", "ln")
