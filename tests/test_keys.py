"""Intent keys: stable across call forms and serializer round trips, distinct across intents."""

from __future__ import annotations

import datetime as dt
import decimal
import inspect
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemmail_celery.errors import IdempotencyKeyError, UnserializableArgumentsError
from idemmail_celery.keys import (
    IntentKeyBuilder,
    Payload,
    address_fields_for,
    canonical_json,
    normalize_address,
    normalize_addresses,
)


def send(to: Any, template: str, order_id: int, locale: str = "en", extra: Any = None) -> None: ...


def builder(**kw: Any) -> IntentKeyBuilder:
    sig = inspect.signature(send)
    kw.setdefault("address_fields", address_fields_for(sig, None))
    return IntentKeyBuilder(task_name="app.send", signature=sig, **kw)


def key(b: IntentKeyBuilder, *args: Any, **kwargs: Any) -> str:
    return b.derive(b.payload(args, kwargs))


# -- golden vectors: a change here re-sends every intent in flight after an upgrade --


def _golden_cases() -> list[tuple[dict[str, Any], tuple[Any, ...], dict[str, Any], str | None, str | None]]:
    return [
        ({}, ("ann@example.com", "receipt", 4821), {}, None, None),
        ({"spec": ("to", "order_id")}, ("Ann <ann@Example.COM>", "receipt", 4821), {}, None, None),
        ({"spec": ("to", "order_id"), "secret": b"s3cret"}, ("ann@example.com", "receipt", 4821), {}, None, None),
        ({"spec": ("to", "order_id"), "version": 2}, ("ann@example.com", "receipt", 4821), {}, None, None),
        ({"spec": ("to", "order_id")}, ("ann@example.com", "receipt", 4821), {}, None, "acme"),
        ({}, ("x@example.com", "t", 1), {}, "order_4821:confirmation", None),
        ({"spec": lambda a, k: f"order:{a[2]}"}, ("x@example.com", "t", 99), {}, None, None),
        ({}, (["b@example.com", "A@Example.com"], "t", 1), {"extra": {"z": [1, 2], "a": "é"}}, None, None),
    ]


GOLDEN_KEYS = [
    "b4da799c3313c45652d8f3f73348b2b9cb8bf375dc7018992925b6ac67cd9b6e",
    "1f4e3272b6b409619a1f1cb21751ec1c78c8cdde434044bea93c6a38a5e78cf1",
    "92718cae4a8f3f47157ce4f177c83570ffbce0f4cc02eafbb830a267ff446f95",
    "9602468ff738a8a7abad3ba929f267cbc4219f0b52e657c54bab8f3119a2d10f",
    "a4727df977a66ec1d0053779c4a56d06aa2ebbbcb4853943885ff1f58a26f9f8",
    "51d2b4d46accfa3b0bbe0e640419cb5e011164914be8b18071af6e6ea6a49b88",
    "c3c39266d48af6897f1557c4130a54c6a19531dc32bbf8fdbb2f8770ca97c14e",
    "69ff26fd0f249ecc6a1eb6d0318c0df9e1adacb348570aa660a665d8fcd8f5a9",
]


def test_golden_vectors_are_stable() -> None:
    got = []
    for opts, args, kwargs, explicit, tenant in _golden_cases():
        b = builder(**opts)
        got.append(b.derive(b.payload(args, kwargs), explicit=explicit, tenant=tenant))
    assert got == GOLDEN_KEYS


def test_key_format_is_the_documented_digest() -> None:
    import hashlib
    import hmac

    material = (
        '{"intent":{"order_id":4821,"to":["ann@example.com"]},'
        '"ns":"idemmail/1","task":"app.send","tenant":null,"v":1}'
    )
    b = builder(spec=("to", "order_id"))
    assert key(b, "Ann <ann@Example.COM>", "receipt", 4821) == hashlib.sha256(material.encode()).hexdigest()
    s = builder(spec=("to", "order_id"), secret=b"k")
    expected = hmac.new(b"k", material.encode(), hashlib.sha256).hexdigest()
    assert key(s, "ann@example.com", "receipt", 4821) == expected


# -- properties --

emails = st.from_regex(r"[a-z][a-z0-9.]{0,8}@[a-z]{1,8}\.(com|org|de)", fullmatch=True)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.text(max_size=12),
                         st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)


@settings(deadline=None, max_examples=150)
@given(to=emails, template=st.text(max_size=10), order_id=st.integers(0, 10**9), extra=json_values,
       display=st.text(alphabet="ABCxyz ", max_size=6))
def test_same_intent_in_any_call_form_gives_same_key(
    to: str, template: str, order_id: int, extra: Any, display: str
) -> None:
    b = builder()
    local, _, domain = to.partition("@")
    dressed = f"{display.strip() or 'X'} <{local}@{domain.upper()}>"
    forms = [
        key(b, to, template, order_id, "en", extra),
        key(b, to, template, order_id, extra=extra),
        key(b, to=to, template=template, order_id=order_id, extra=extra, locale="en"),
        key(b, dressed, template, order_id, extra=extra),
        key(b, [to, to], template, order_id, extra=extra),
    ]
    assert len(set(forms)) == 1
    # What the worker recomputes from the message it received gives the same key.
    p = b.payload((to, template, order_id), {"extra": extra})
    assert b.derive(Payload(list(p.args), dict(p.kwargs))) == forms[0]


@settings(deadline=None, max_examples=150)
@given(a=st.tuples(emails, st.integers(0, 10**6), st.text(max_size=8)),
       b_=st.tuples(emails, st.integers(0, 10**6), st.text(max_size=8)))
def test_any_change_to_a_key_field_changes_the_key(a: tuple[str, int, str], b_: tuple[str, int, str]) -> None:
    b = builder(spec=("to", "order_id", "template"))
    ka = key(b, a[0], a[2], a[1])
    kb = key(b, b_[0], b_[2], b_[1])
    same_intent = (normalize_address(a[0]) == normalize_address(b_[0]) and a[1] == b_[1] and a[2] == b_[2])
    assert (ka == kb) == same_intent


@settings(deadline=None, max_examples=100)
@given(recipients=st.lists(emails, min_size=1, max_size=5))
def test_recipient_order_and_duplicates_do_not_matter(recipients: list[str]) -> None:
    b = builder(spec=("to", "order_id"))
    assert key(b, recipients, "t", 1) == key(b, list(reversed(recipients)) + recipients[:1], "t", 1)


def test_fields_outside_the_key_do_not_change_it_and_namespaces_do() -> None:
    b = builder(spec=("to", "order_id"))
    assert key(b, "a@example.com", "receipt", 1) == key(b, "a@example.com", "other template", 1, locale="de")
    base = key(b, "a@example.com", "t", 1)
    assert builder(spec=("to", "order_id"), version=2).derive(b.payload(("a@example.com", "t", 1), {})) != base
    assert b.derive(b.payload(("a@example.com", "t", 1), {}), tenant="acme") != base
    other_task = IntentKeyBuilder(task_name="app.other", signature=b.signature, spec=("to", "order_id"),
                                  address_fields=b.address_fields)
    assert key(other_task, "a@example.com", "t", 1) != base
    assert builder(spec=("to", "order_id"), secret=b"x").derive(b.payload(("a@example.com", "t", 1), {})) != base


def test_tuples_and_lists_agree_after_the_round_trip() -> None:
    b = builder()
    assert key(b, "a@example.com", "t", 1, extra=(1, 2)) == key(b, "a@example.com", "t", 1, extra=[1, 2])


def test_kombu_typed_values_have_one_canonical_form() -> None:
    b = builder()
    when = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.timezone.utc)
    k1 = key(b, "a@example.com", "t", 1, extra={"at": when, "amount": decimal.Decimal("9.90"), "id": uuid.UUID(int=7)})
    k2 = key(b, "a@example.com", "t", 1, extra={"at": when, "amount": decimal.Decimal("9.90"), "id": uuid.UUID(int=7)})
    assert k1 == k2
    assert canonical_json({"b": 1, "a": [1.5, "é"]}) == '{"a":[1.5,"é"],"b":1}'


def test_key_carries_no_raw_argument_values() -> None:
    k = key(builder(), "secret.person@example.com", "t", 4821)
    assert len(k) == 64 and set(k) <= set("0123456789abcdef")
    assert "secret" not in k and "4821" not in k


def test_address_normalisation() -> None:
    assert normalize_address("Ann Example <Ann.X@Example.COM>") == "Ann.X@example.com"
    assert normalize_addresses("a@B.com, c@d.com") == ["a@b.com", "c@d.com"]
    assert normalize_addresses(["c@D.com", "a@b.com", "c@d.com"]) == ["a@b.com", "c@d.com"]
    assert normalize_addresses(42) == 42


# -- bad input: typed errors before anything is enqueued --


def test_unknown_key_field_is_rejected_at_definition() -> None:
    with pytest.raises(IdempotencyKeyError, match="'order'"):
        builder(spec=("to", "order"))
    with pytest.raises(IdempotencyKeyError, match="tuple of argument names"):
        builder(spec="to")  # a bare string, not a tuple
    with pytest.raises(IdempotencyKeyError, match="version"):
        builder(version=0)


def test_arguments_that_do_not_fit_the_signature_are_rejected() -> None:
    b = builder()
    with pytest.raises(IdempotencyKeyError, match="signature"):
        key(b, "a@example.com")  # template and order_id missing
    with pytest.raises(IdempotencyKeyError, match="signature"):
        key(b, "a@example.com", "t", 1, nonsense=2)
    bad_calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("a@example.com", "t"), {"nonsense": 1}),  # one missing, one unknown: as many names as the signature
        (("a@example.com", "t", 1), {"to": "b@example.com"}),  # to given twice
        (("a@example.com", "t", 1, "en", None, "one too many"), {}),
        ((), {"template": "t", "order_id": 1}),
    ]
    for args, kwargs in bad_calls:
        with pytest.raises(IdempotencyKeyError, match="signature"):
            key(b, *args, **kwargs)


def test_plain_signatures_bind_as_inspect_does() -> None:
    """bound() skips Signature.bind for plain signatures; it must agree with it on every call that fits."""
    b = builder()
    sig = inspect.signature(send)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("a@example.com", "t", 1), {}),
        (("a@example.com",), {"order_id": 1, "template": "t", "extra": (1, 2)}),
        ((), {"to": "a@example.com", "template": "t", "order_id": 1, "locale": "de"}),
        (("a@example.com", "t", 1, "fr", {"k": [1]}), {}),
    ]
    for args, kwargs in calls:
        p = b.payload(args, kwargs)
        ba = sig.bind(*p.args, **p.kwargs)
        ba.apply_defaults()
        assert b.bound(p) == dict(ba.arguments)


def test_unserialisable_arguments_are_rejected() -> None:
    b = builder()
    with pytest.raises(UnserializableArgumentsError):
        key(b, "a@example.com", "t", 1, extra=object())
    with pytest.raises(UnserializableArgumentsError):
        key(b, "a@example.com", "t", 1, extra=float("nan"))


def test_key_function_must_return_a_string() -> None:
    b = builder(spec=lambda a, k: None)
    with pytest.raises(IdempotencyKeyError, match="returned NoneType"):
        key(b, "a@example.com", "t", 1)


def test_must_match_reports_differing_fields() -> None:
    b = builder(spec=("order_id",), must_match=("to",))
    first = b.payload(("a@example.com", "t", 1), {})
    later = b.payload(("b@example.com", "t2", 1), {})
    assert b.derive(first) == b.derive(later)
    assert b.mismatched_fields(first, later) == ("to",)
    assert b.mismatched_fields(first, b.payload(("a@example.com", "t3", 1), {})) == ()
