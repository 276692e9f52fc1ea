"""A constraint is one more owner of a session: a chunk's flip publishes its value after the
chunk's tokens, an abort leaves the public value as it was, and sampling takes only the tokens
it allows. Grammars through llguidance (`hebrus.text.grammar`)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hebrus
from hebrus import ChunkAborted, InvalidInput
from hebrus.batching import feed_keeping_many, feed_many
from hebrus.sampling import constrained
from hebrus.text.grammar import Grammar

pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def start(model, grammar):
    return Grammar.of(grammar).start(model.tokenizer, model.spec.vocab_size)


def text(ids) -> str:
    return bytes(ids).decode("utf-8")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_generation_it_finishes_matches_the_schema(tiny_fast, temperature):
    jsonschema = pytest.importorskip("jsonschema")
    for seed in range(3):
        s = tiny_fast.session()
        out = list(s.generate([1, 2, 3], max_new_tokens=120, temperature=temperature, seed=seed,
                              constraint=start(tiny_fast, PERSON)))
        assert s.constraint.finished, text(out)           # it ended because the schema allowed no more
        jsonschema.validate(json.loads(text(out)), PERSON)
        assert s.frontier == 3 + len(out)


def test_a_chunk_it_does_not_allow_is_refused_and_changes_nothing(tiny_fast):
    s = tiny_fast.session()
    s.feed([5, 6])
    s.constrain(start(tiny_fast, PERSON))
    before, value = s.digest(), s.constraint
    for bad in ([ord("x")], [ord("{"), ord("x")]):
        with pytest.raises(InvalidInput, match="does not allow token 120 at position"):
            s.feed(bad)
        with pytest.raises(InvalidInput, match="does not allow"):
            s.prefill(bad)
        with pytest.raises(InvalidInput, match="session 1: .*does not allow"):
            feed_many([tiny_fast.session(), s], [[1], bad])
    assert s.digest() == before and s.constraint is value and s.frontier == 2


def test_an_abort_leaves_the_public_constraint_as_it_was(tiny_fast):
    s = tiny_fast.session()
    s.feed([5])
    s.constrain(start(tiny_fast, PERSON))
    s.feed(list(b'{"na'))
    value, digest = s.constraint, s.digest()
    with hebrus.inject(stage="head", kind="nonfinite"):
        with pytest.raises(ChunkAborted):
            s.feed(list(b'me": "'))
    assert s.constraint is value and s.digest() == digest
    assert s.constraint.allows(list(b'me": "')) == 6       # and it goes on from where it was
    s.feed(list(b'me": "'))
    assert s.constraint is not value and s.constraint.allows([ord("B")]) == 1


def test_the_state_is_what_the_same_tokens_give_without_it(tiny):
    """Exact mode: the constrained session holds bit for bit what an unconstrained one fed the
    same tokens holds."""
    s = tiny.session()
    out = list(s.generate([7, 8], max_new_tokens=60, temperature=1.0, seed=4, constraint=start(tiny, PERSON)))
    plain = tiny.session()
    for chunk in ([7, 8], *([t] for t in out)):
        plain.feed(chunk)
    assert s.digest() == plain.digest()


def test_fork_copy_and_kept_sessions_carry_their_own_value(tiny_fast):
    s = tiny_fast.session()
    s.feed([9])
    s.constrain(start(tiny_fast, PERSON))
    fork = s.fork()
    assert fork.constraint is s.constraint
    logits, kept = s.feed_keeping(list(b'{"name'), [2, 6])
    assert kept[0].constraint.allows(list(b'name')) == 4 and kept[0].constraint.allows(list(b'age')) == 0
    assert kept[1].constraint.allows(list(b'": "')) == 4
    fork.feed(list(b'{"name": "Z'))                      # the fork diverges on its own
    assert s.constraint.allows(list(b'": "')) == 4 and fork.constraint.allows([ord('"')]) == 1
    copy = tiny_fast.from_host(s.host_copy())
    assert copy.constraint is s.constraint and copy.digest() == s.digest()
    results = feed_keeping_many([s, fork], [list(b'": "'), [ord('"')]], [[1], []])
    assert s.constraint.allows([ord("B")]) == 1 and results[0][1][0].constraint.allows([ord(":")]) == 1
    assert fork.constraint.allows(list(b', "age')) == 6


def test_a_prefix_transaction_keeps_no_more_than_it_allows(tiny_fast):
    s = tiny_fast.session()
    s.feed([3])
    s.constrain(start(tiny_fast, PERSON))
    twin = s.fork()
    k, logits = s.feed_prefix(list(b'{"nx'), lambda logits: 4)
    assert k == 3 and s.frontier == 4 and logits.shape[0] == 4
    assert s.constraint.allows(list(b'ame')) == 3
    assert twin.feed_prefix_twice(list(b'{"nx'), lambda logits: 4)[0] == 3
    assert twin.frontier == 4 and twin.constraint.allows(list(b'ame')) == 3


def test_a_constrained_session_is_not_saved_and_lifting_it_frees_the_tokens(tiny_fast, tmp_path):
    s = tiny_fast.session()
    s.feed([3])
    s.constrain(start(tiny_fast, PERSON))
    with pytest.raises(InvalidInput, match="cannot be saved"):
        s.save(tmp_path / "s.hebrus")
    assert not (tmp_path / "s.hebrus").exists()
    s.constrain(None)
    s.feed([ord("x")])
    s.save(tmp_path / "s.hebrus")
    with pytest.raises(InvalidInput, match="constraint needs"):
        s.constrain("not a constraint")


def test_steps_of_many_sessions_advance_each_ones_value(tiny_fast):
    sessions = [tiny_fast.session() for _ in range(3)]
    for s in sessions:
        s.feed([1])
    sessions[0].constrain(start(tiny_fast, PERSON))
    sessions[2].constrain(start(tiny_fast, Grammar.regex("[ab]+")))
    feed_many(sessions, [[ord("{")], [ord("z")], [ord("a")]])
    assert sessions[0].constraint.allows([ord('"')]) == 1 and sessions[1].constraint is None
    assert sessions[2].constraint.allows([ord("b")]) == 1 and sessions[2].constraint.allows([ord("c")]) == 0


def test_masks_of_a_batch_in_one_call():
    logits = torch.zeros(2, 40)
    masks = [torch.tensor([0b101, 0], dtype=torch.int32), torch.tensor([0, 1 << 3], dtype=torch.int32)]
    out = constrained(logits, masks)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [35]
    assert torch.equal(constrained(logits[0], masks[:1]), out[0])


def test_masks_against_their_definition_bit_by_bit():
    """Token 32 w + j is allowed exactly when bit j of word w is set (bit 31, the sign bit,
    too); a mask shorter than the vocabulary allows nothing past its words."""
    gen = torch.Generator().manual_seed(0)
    V = 150
    masks = [torch.randint(-2**31, 2**31 - 1, (5,), generator=gen, dtype=torch.int32),
             torch.tensor([-1, -2**31, 0, 1, 2**30], dtype=torch.int32),
             torch.randint(-2**31, 2**31 - 1, (3,), generator=gen, dtype=torch.int32)]
    logits = torch.randn(3, V, generator=gen)
    out = constrained(logits, masks)
    for b, m in enumerate(masks):
        for t in range(V):
            allowed = t < 32 * m.numel() and (int(m[t // 32]) >> (t % 32)) & 1
            assert (out[b, t] == logits[b, t]) if allowed else out[b, t] == float("-inf"), (b, t)


def test_grammars_it_cannot_compile_are_refused_by_name(tiny_fast):
    with pytest.raises(InvalidInput, match="not supported.*if"):
        start(tiny_fast, {"type": "object", "if": {"required": ["a"]}})
    with pytest.raises(InvalidInput, match="not valid JSON"):
        Grammar.json("{nope")
    with pytest.raises(InvalidInput, match="regular expression"):
        start(tiny_fast, Grammar.regex("(unclosed"))
    with pytest.raises(InvalidInput, match="a JSON schema"):
        Grammar.of(42)
    s = tiny_fast.session()
    out = list(s.generate([1], max_new_tokens=50, constraint=start(tiny_fast, Grammar.regex("(yes|no)"))))
    assert text(out) in ("yes", "no") and s.constraint.finished


# ---- property: every output that ends with "stop" is valid -----------------------------------
LONG = os.environ.get("HEBRUS_HYPOTHESIS") == "long"


def _schemas():
    """JSON schemas of the subset the grammar takes, small enough for a tiny model to finish:
    objects with required properties in order, arrays of at most 3 items, bounded strings and
    integers, enums, booleans, null."""
    leaves = st.one_of(
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
            lambda values: {"enum": values}),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-c]{1,3}$", "^x?y$"])))

    def nested(children):
        return st.one_of(
            st.builds(lambda item, most: {"type": "array", "items": item, "maxItems": most}, children, st.integers(0, 3)),
            st.dictionaries(st.text("abkq", min_size=1, max_size=3), children, min_size=1, max_size=3).map(
                lambda props: {"type": "object", "properties": props, "required": list(props),
                               "additionalProperties": False}))
    return st.recursive(leaves, nested, max_leaves=5)


@settings(max_examples=200 if LONG else 12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_schemas(), seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 0.8, 1.5]))
def test_generated_schemas_every_finished_output_is_valid(tiny_fast, schema, seed, temperature):
    jsonschema = pytest.importorskip("jsonschema")
    s = tiny_fast.session()
    out = list(s.generate([seed % 256], max_new_tokens=160, temperature=temperature, seed=seed,
                          constraint=start(tiny_fast, schema)))
    if s.constraint.finished:
        jsonschema.validate(json.loads(text(out)), schema)


@settings(max_examples=100 if LONG else 10, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_schemas(), data=st.data())
def test_every_valid_instance_is_allowed(tiny_fast, schema, data):
    """The other way: any instance of the schema, written in the grammar's layout, is allowed
    token by token and completes it. (The instances come from `_instances`, not
    hypothesis-jsonschema, whose object strategy fails on this hypothesis: "'many' object has no
    attribute 'more'".)"""
    jsonschema = pytest.importorskip("jsonschema")
    instance = data.draw(_instances(schema))
    jsonschema.validate(instance, schema)
    ids = list(json.dumps(instance, ensure_ascii=False).encode())
    value = start(tiny_fast, schema)
    assert value.allows(ids) == len(ids), (schema, instance)
    assert value.after(ids).complete


def _instances(schema):
    """Instances of a schema of `_schemas`, objects' keys in its order (the grammar's), strings
    of printable ASCII without escapes (how a string is escaped is the grammar's choice)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if kind == "string" and "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True)
    if kind == "string":
        return st.text(st.characters(min_codepoint=32, max_codepoint=126, exclude_characters='"\\'),
                       max_size=schema["maxLength"])
    if kind == "array":
        return st.lists(_instances(schema["items"]), max_size=schema["maxItems"])
    order = list(schema["properties"])
    return st.fixed_dictionaries({k: _instances(v) for k, v in schema["properties"].items()}).map(
        lambda d: {k: d[k] for k in order})


def test_masks_of_many_together_are_each_ones_alone(tiny_fast, monkeypatch):
    from hebrus.state.constraint import masks
    from hebrus.text import grammar
    monkeypatch.setattr(grammar, "PARALLEL_MASKS", 2)
    begin = start(tiny_fast, PERSON)
    prefixes = [b'{"name": "' + bytes([97 + i]) for i in range(6)] + [b'{"name": "ab", "age": 1', b'']
    together = masks([begin.after(list(p)) if p else start(tiny_fast, PERSON) for p in prefixes])
    alone = [(begin.after(list(p)) if p else start(tiny_fast, PERSON)).mask() for p in prefixes]
    for a, b in zip(together, alone):
        n = min(a.numel(), b.numel())
        assert torch.equal(a[:n], b[:n]) and not a[n:].any() and not b[n:].any()


def test_speculation_under_a_constraint_is_the_plain_output(tiny):
    """Exact mode, greedy: prompt lookup under a schema gives the tokens and the final state of
    plain decoding under it (drafts kept only as far as it allows); sampled, what finishes is
    valid."""
    jsonschema = pytest.importorskip("jsonschema")
    prompt = list(b'{"name": "Al", "age": 7} {"name": "Al", "age": 7} ')
    plain, fast = tiny.session(), tiny.session()
    a = list(plain.generate(prompt, max_new_tokens=60, constraint=start(tiny, PERSON)))
    b = list(fast.generate(prompt, max_new_tokens=60, constraint=start(tiny, PERSON), speculate="lookup"))
    assert a == b and plain.digest() == fast.digest() and fast.constraint.finished
    for seed in range(2):
        s = tiny.session()
        out = list(s.generate(prompt, max_new_tokens=80, temperature=1.0, seed=seed,
                              constraint=start(tiny, PERSON), speculate="lookup"))
        if s.constraint.finished:
            jsonschema.validate(json.loads(text(out)), PERSON)


def test_values_made_ahead_of_a_step_are_the_ones_it_publishes(tiny_fast):
    from hebrus.state.constraint import ahead
    sessions = [tiny_fast.session() for _ in range(3)]
    for s in sessions:
        s.feed([1])
        s.constrain(start(tiny_fast, PERSON))
    tokens = [ord("{")] * 3
    made = ahead([(s.constraint, t) for s, t in zip(sessions, tokens)])
    expected = [s.constraint.after([t]) for s, t in zip(sessions, tokens)]   # the same values, whoever made them
    made.join()
    feed_many(sessions, [[t] for t in tokens])
    for s, value in zip(sessions, expected):
        assert s.constraint is value and value._mask is not None


def test_work_made_ahead_that_fails_leaves_the_next_to_run(tiny_fast):
    """`ahead` hands its work to one thread for the process: a value whose `after` raises is
    joined like any other, and work handed after it still runs."""
    from hebrus.state.constraint import ahead

    class Broken:
        def after(self, tokens):
            raise RuntimeError("broken")
    made = ahead([(Broken(), 1)])
    made.join(timeout=60)
    assert made.done.is_set()
    value = start(tiny_fast, PERSON)
    made = ahead([(value, ord("{"))])
    made.join(timeout=60)
    assert made.done.is_set() and value.after([ord("{")])._mask is not None
    assert ahead([]) is None


def test_many_choices_sharing_one_value_compute_its_mask_once(tiny_fast, monkeypatch):
    from hebrus.state.constraint import masks
    from hebrus.text import grammar
    monkeypatch.setattr(grammar, "PARALLEL_MASKS", 2)
    value = start(tiny_fast, PERSON)
    got = masks([value] * 5 + [value.after([ord("{")])] * 3)
    assert all(torch.equal(got[0], g) for g in got[:5]) and all(torch.equal(got[5], g) for g in got[5:])


def test_a_journaled_session_takes_no_constraint(tiny_fast, tmp_path):
    s = tiny_fast.session(journal=tmp_path / "j")
    with pytest.raises(InvalidInput, match="journaled"):
        s.constrain(start(tiny_fast, PERSON))
