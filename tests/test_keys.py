"""Intent keys: stable across call forms and serializer round trips, distinct across intents."""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import hmac
import inspect
import re
import unicodedata
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idemmail_celery.errors import ConfigurationError, IdempotencyKeyError, InvalidEmail, UnserializableArgumentsError
from idemmail_celery.keys import (
    MAX_EXPLICIT_KEY_LENGTH,
    IntentKeyBuilder,
    Payload,
    address_fields_for,
    canonical_json,
    check_explicit_key,
    is_derived_key,
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


def test_keyword_only_signatures_bind_as_inspect_does_and_refuse_what_it_refuses() -> None:
    """send_email's shape: keyword-only arguments take the fast path too, with the same answers."""
    def mail(to: Any, *, subject: str = "", cc: Any = None, event_id: Any = None) -> None: ...

    sig = inspect.signature(mail)
    b = IntentKeyBuilder(task_name="tests.mail", signature=sig, secret=b"s")
    assert b._plain is not None
    for args, kwargs in [(("a@example.com",), {"subject": "Hi"}), ((), {"to": "a@example.com", "event_id": 7})]:
        p = b.payload(args, kwargs)
        ba = sig.bind(*p.args, **p.kwargs)
        ba.apply_defaults()
        assert b.bound(p) == dict(ba.arguments)
    for args, kwargs in [(("a@example.com", "Hi"), {}), ((), {"subject": "Hi"}), ((), {"to": "a", "bcc": "b"})]:
        with pytest.raises(IdempotencyKeyError):  # a keyword-only one given by position, a missing or unknown one
            b.bound(b.payload(args, kwargs))


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


# -- one intent, one key (issue 13): spellings of one call agree, already-canonical keys stay --

#: Canonical inputs whose keys this release must not change (computed with the release before).
UNCHANGED = [
    (({}, ("zoe@exämple.com", "t", 1), {}, None, None),
     "bef241400e2f66184bde19bdca10838801636e81dd39d2a14e0b7fc7023053ab"),
    (({"spec": ("to", "order_id")}, ("Jürgen <jürgen@Exämple.com>", "t", 1), {}, None, None),
     "1f8c272cb8e672b244de98ab4f6b761098932c6f40af680ddfdcd4081dc0ebcc"),
    (({}, ("a@example.com", "t", 1), {"extra": {"amount": 2.5, "n": [1, 2.25]}}, None, None),
     "b7898a3b42d09570f1f1c8933c51fb406fc8ec1c48bf055d6d9e27864b4b2483"),
    (({"secret": b"k"}, (["Ann <ann@example.com>", "bob@example.org"], "t", 7), {"locale": "de"}, None, None),
     "c8f626a47ce3a675d718220e437e8632d5870b3eadcfd67cc5d8412912361994"),
    (({}, ("a@example.com", "t", 1), {}, "Order 4821 / confirmation ✓", "acme"),
     "99ec05378ab0fad84922999d45ffa6e0d8720839e3994682837f31412a49b2ce"),
]


@pytest.mark.parametrize("case,expected", UNCHANGED)
def test_keys_of_canonical_inputs_did_not_change(case: Any, expected: str) -> None:
    opts, args, kwargs, explicit, tenant = case
    b = builder(**opts)
    assert b.derive(b.payload(args, kwargs), explicit=explicit, tenant=tenant) == expected


@pytest.mark.parametrize("one,other", [
    ("zoe@exämple.com", "zoe@xn--exmple-cua.com"),  # IDN in Unicode and in punycode
    ("zoe@exämple.com", "Zoë <zoe@XN--EXMPLE-CUA.com>"),
    ("jürgen@example.com", unicodedata.normalize("NFD", "jürgen@example.com")),  # NFC and NFD
    ("Ann <ann@example.com>", '"Ann" <ann@EXAMPLE.com>'),
])
def test_spellings_of_one_mailbox_give_one_key(one: str, other: str) -> None:
    assert normalize_address(one) == normalize_address(other)
    b = builder(spec=("to", "order_id"))
    assert key(b, one, "t", 1) == key(b, other, "t", 1)


def test_one_and_one_point_zero_give_one_key() -> None:
    b = builder()
    assert key(b, "a@example.com", "t", 1, extra=1) == key(b, "a@example.com", "t", 1, extra=1.0)
    assert key(b, "a@example.com", "t", 1, extra={"n": [2, -0.0]}) == key(b, "a@example.com", "t", 1,
                                                                             extra={"n": [2.0, 0]})
    assert key(b, "a@example.com", "t", 1, extra=1.5) != key(b, "a@example.com", "t", 1, extra=1)
    assert canonical_json([1.0, 2.5, 2.0**60]) == "[1,2.5,1152921504606846976]"
    # However large: an integral float is exactly one integer, and the same number in either type is one intent.
    assert key(b, "a@example.com", "t", 1, extra=2**60) == key(b, "a@example.com", "t", 1, extra=2.0**60)
    assert key(b, "a@example.com", "t", 1, extra=int(1e300)) == key(b, "a@example.com", "t", 1, extra=1e300)


def test_normalize_address_is_the_de_duplication_form() -> None:
    assert normalize_address("Ann Example <Ann.X@Example.COM>") == "Ann.X@example.com"  # local part kept
    assert normalize_address(" ann@example.com ") == "ann@example.com"
    assert normalize_address("Ann <not-an-address>") == "not-an-address"  # read leniently, never valid
    assert normalize_address("Ann <x.@Example.com>") == normalize_address("x.@example.com")
    assert normalize_addresses(["", "a@b.com", " "]) == ["a@b.com"]
    assert normalize_addresses('"Smith, Ann" <ann@example.com>, bob@example.com') == [
        "ann@example.com", "bob@example.com"]


# -- send_email's intent: one call, one key, however it is spelled --


@pytest.fixture
def send_email_task() -> Any:
    from celery import Celery

    from idemmail_celery.mail import register

    app = Celery("keys-test", set_as_current=False)
    app.conf.idemmail_provider_url = "console://"
    return register(app)


#: send_email calls whose keys this release must not change (computed with the release before).
SEND_EMAIL_UNCHANGED = [
    ({"to": "ann@example.com", "subject": "Your receipt", "html": "<p>Thanks</p>", "event_id": "order_4821",
      "template": "receipt"}, "0fcd1234dde60515d73dea437925e916747d3777431b8ef00608d4b541e7220a"),
    ({"to": ["Ann <ann@Example.COM>", "bob@example.org"], "cc": "c@example.com", "subject": "s", "text": "t",
      "event_id": "e-1"}, "c947ae3205c66f2344fe28fb0ac650fdd7da8581518e311daf170e0fc3ee2d5d"),
    ({"to": "ann@example.com", "subject": "Reset", "text": "link"},
     "89ba8065d1cac2f947a16ca99567076b04e416216530d4a012aef29830e352b0"),
    ({"to": "zoe@exämple.com", "subject": "Hi", "text": "t", "from_": "Shop <shop@example.com>",
      "reply_to": "help@example.com", "headers": {"X-A": "1"}, "tags": {"k": "v"}, "tenant": "acme"},
     "4ec94ec4f6ea097527122d230c394b3ae54fcf7568d3f1728d84e09fa21c7500"),
]


@pytest.mark.parametrize("kwargs,expected", SEND_EMAIL_UNCHANGED)
def test_send_email_keys_of_canonical_calls_did_not_change(send_email_task: Any, kwargs: dict[str, Any],
                                                          expected: str) -> None:
    assert send_email_task.intent_key(**kwargs) == expected


@pytest.mark.parametrize("base,variants", [
    ({"to": "ann@example.com", "subject": "s", "text": "t", "event_id": "4821"},
     [{"cc": None}, {"cc": []}, {"cc": ""}, {"bcc": []}, {"event_id": 4821}, {"to": ["ann@example.com"]},
      {"to": "Ann <ann@EXAMPLE.com>"}, {"subject": "other"}]),
    ({"to": "zoe@exämple.com", "subject": "s", "text": "t", "event_id": "e"},
     [{"to": "zoe@xn--exmple-cua.com"}, {"to": "Zoë <zoe@Exämple.com>"}]),
    ({"to": "jürgen@example.com", "subject": "s", "text": "t", "event_id": "e"},
     [{"to": unicodedata.normalize("NFD", "jürgen@example.com")}]),
    ({"to": "ann@example.com", "subject": "s", "text": "t"},  # no event_id: the whole content is the intent
     [{"cc": []}, {"cc": ""}, {"reply_to": []}, {"headers": {}}, {"tags": {}}, {"attachments": []}]),
    ({"to": "ann@example.com", "text": "t"}, [{"subject": ""}]),
])
def test_send_email_spellings_of_one_call_give_one_key(send_email_task: Any, base: dict[str, Any],
                                                      variants: list[dict[str, Any]]) -> None:
    expected = send_email_task.intent_key(**base)
    for change in variants:
        assert send_email_task.intent_key(**{**base, **change}) == expected, change


@pytest.mark.parametrize("change", [{"event_id": 1.0}, {"event_id": True}, {"event_id": ""}, {"event_id": [1]},
                                    {"template": 3}])
def test_send_email_refuses_event_ids_that_have_no_single_spelling(send_email_task: Any,
                                                                   change: dict[str, Any]) -> None:
    kwargs = {"to": "ann@example.com", "subject": "s", "text": "t", "event_id": "e", **change}
    with pytest.raises(InvalidEmail) as info:
        send_email_task.intent_key(**kwargs)
    assert info.value.field in ("event_id", "template")
    with pytest.raises(InvalidEmail):
        send_email_task.check_call((), kwargs)


# -- secret rotation --


def test_rotation_derives_under_the_first_secret_and_gives_the_older_keys() -> None:
    call = (("ann@example.com", "t", 1), {})
    new, old = builder(secret=b"new"), builder(secret=b"old")
    rotating = builder(secret=[b"new", b"old"])
    p = rotating.payload(*call)
    assert rotating.derive(p) == new.derive(p)
    assert rotating.older_keys(p) == (old.derive(p),)
    assert rotating.older_keys(p, explicit="order-1", tenant="acme") == (old.derive(p, explicit="order-1",
                                                                                    tenant="acme"),)
    leaving_plain = builder(secret=["new", None])  # str secrets too; None: keys made without a secret
    assert leaving_plain.older_keys(p) == (builder().derive(p),)
    assert builder(secret=[b"new", b"new"]).older_keys(p) == ()  # a repeat is one secret


def test_older_keys_cost_nothing_with_one_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    b = builder(secret=b"only")

    def no_work(*_: Any) -> str:
        raise AssertionError("older_keys derived something with a single secret")

    monkeypatch.setattr(IntentKeyBuilder, "_material", no_work)
    assert b.older_keys(b.payload(("a@example.com", "t", 1), {})) == ()


def test_fingerprints_made_under_an_older_secret_still_match() -> None:
    old = builder(spec=("order_id",), must_match=("to",), secret=b"old")
    rotating = builder(spec=("order_id",), must_match=("to",), secret=[b"new", b"old"])
    p = old.payload(("a@example.com", "t", 1), {})
    assert rotating.fingerprint(p) != old.fingerprint(p)
    assert rotating.fingerprint_matches(old.fingerprint(p), p)
    assert rotating.fingerprint_matches(rotating.fingerprint(p), p)
    assert not rotating.fingerprint_matches(old.fingerprint(old.payload(("b@example.com", "t", 1), {})), p)


@pytest.mark.parametrize("secret", [b"", [], ["new", ""], 42])
def test_bad_secrets_are_configuration_errors(secret: Any) -> None:
    with pytest.raises(ConfigurationError):
        builder(secret=secret)


# -- explicit and raw keys: validated, namespaced and hashed --


def test_an_explicit_key_is_namespaced_and_hashed_like_a_derived_one() -> None:
    b = builder(secret=b"s")
    p = b.payload(("a@example.com", "t", 1), {})
    k = b.explicit_key("order-4821:confirmation")
    assert k == b.derive(p, explicit="order-4821:confirmation") and is_derived_key(k)
    assert "4821" not in k
    material = '{"explicit":"order-4821:confirmation","ns":"idemmail/1","task":"app.send","tenant":"acme","v":1}'
    assert b.explicit_key("order-4821:confirmation", tenant="acme") == hmac.new(
        b"s", material.encode(), hashlib.sha256).hexdigest()
    other_task = IntentKeyBuilder(task_name="app.other", signature=b.signature, secret=b"s")
    assert other_task.explicit_key("order-4821:confirmation") != k  # namespaced per task


@pytest.mark.parametrize("raw,why", [
    (4821, "must be a str"), (b"order", "must be a str"), (None, "must be a str"), ("", "empty"), ("   ", "empty"),
    ("x" * (MAX_EXPLICIT_KEY_LENGTH + 1), "over 255"), ("order\n1", "U+000A"), ("order\u20281", "U+2028"),
    ("order\x001", "U+0000"), ("order\x851", "U+0085"),
])
def test_explicit_keys_are_checked_with_a_typed_error(raw: Any, why: str) -> None:
    b = builder()
    with pytest.raises(IdempotencyKeyError, match=re.escape(why)):
        b.explicit_key(raw)
    if raw is not None:  # derive(explicit=None) means "no explicit key"
        with pytest.raises(IdempotencyKeyError, match=re.escape(why)):
            b.derive(b.payload(("a@example.com", "t", 1), {}), explicit=raw)
    with pytest.raises(IdempotencyKeyError, match=re.escape(why)):
        check_explicit_key(raw)


def test_derived_keys_are_recognised() -> None:
    assert is_derived_key(key(builder(), "a@example.com", "t", 1))
    for other in ("order-1", "A" * 64, "a" * 63, 42, None, "g" * 64):
        assert not is_derived_key(other)


# -- Celery-free: the state machine imports this module, and it writes what kombu wrote --


@pytest.mark.parametrize("module", [
    "keys",
    "redaction",
    "handler",
])
def test_the_state_machines_modules_import_without_celery_or_kombu(module: str) -> None:
    """Imported in a process where importing celery or kombu fails (the package's __init__, which
    registers tasks, is skipped: it is the adapters' door, not the handler's)."""
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "idemmail_celery"
    code = (
        "import sys, types, importlib.abc\n"
        "class NoCelery(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('celery', 'kombu'):\n"
        "            raise ImportError(f'{name} imported')\n"
        "sys.meta_path.insert(0, NoCelery())\n"
        "pkg = types.ModuleType('idemmail_celery'); pkg.__path__ = [sys.argv[1]]\n"
        "sys.modules['idemmail_celery'] = pkg\n"
        f"import idemmail_celery.{module}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def typed_values() -> list[Any]:
    return [
        dt.datetime(2026, 11, 21, 12, 0, 5, 123, tzinfo=dt.timezone.utc), dt.datetime(2026, 1, 2, 3, 4),
        dt.date(2026, 11, 21), dt.time(12, 30, 1), decimal.Decimal("9.90"), decimal.Decimal("-1E+3"),
        uuid.UUID(int=7), b"plain bytes", b"\xff\xfe not utf-8", "é ✓", 1.5, 10**20, None, True,
        {"nested": [dt.date(2026, 1, 1), {"amount": decimal.Decimal("0.1")}]}, (1, 2),
    ]


def test_payloads_are_stored_in_the_text_kombus_json_wrote_and_read_back_alike() -> None:
    from kombu.utils.json import dumps as kombu_dumps
    from kombu.utils.json import loads as kombu_loads

    payload = Payload(typed_values(), {"at": dt.datetime(2026, 11, 21, tzinfo=dt.timezone.utc), "raw": b"\x00\xff"})
    text = payload.to_json()
    assert text == kombu_dumps({"args": payload.args, "kwargs": payload.kwargs})
    back = Payload.from_json(text)
    expected = kombu_loads(text)
    assert (back.args, back.kwargs) == (expected["args"], expected["kwargs"])


def test_the_builders_own_json_round_trip_gives_the_keys_celerys_gives() -> None:
    """Without the adapter (the handler, these tests) and with it (kombu's serializer registry), one key."""
    from celery import Celery

    from idemmail_celery import IdempotentTask

    app = Celery("keys-round-trip", set_as_current=False)
    app.conf.update(idemmail_ledger_url="sqlite://", idemmail_key_secret="s")

    @app.task(name="app.send", shared=False, base=IdempotentTask)
    def adapter_send(to: Any, template: str, order_id: int, locale: str = "en", extra: Any = None) -> None: ...

    plain = builder(secret=b"s")
    for value in typed_values():
        call = (("a@example.com", "t", 1), {"extra": {"v": value, "l": [value]}})
        assert plain.payload(*call) == adapter_send.key_builder.payload(*call)
        assert key(plain, *call[0], **call[1]) == adapter_send.intent_key(*call[0], **call[1])
    with pytest.raises(ConfigurationError, match="round trip"):
        builder(serializer="pickle")  # only the adapter knows kombu's other serializers


# -- the seal over the headers the worker acts on (issue 24) --

def test_a_seal_covers_every_header_the_worker_acts_on_the_task_and_the_arguments() -> None:
    from idemmail_celery.chain import KEY_MARK_HEADER, SEALED_HEADERS, TENANT_HEADER
    from idemmail_celery.keys import Seal

    b = builder(secret="s")
    call = b.payload(("ann@example.com", "receipt", 1), {})
    headers: dict[str, Any] = {name: f"v-{name}" for name in SEALED_HEADERS}
    headers["idemmail_verdict"] = {"state": "sent", "result": {"message_id": "m"}, "owner": "o:1"}
    headers[KEY_MARK_HEADER] = b.seal(headers, call)
    assert b.check_seal(headers, call) is Seal.VALID
    assert b.check_seal({**headers, TENANT_HEADER: "t", "other": 1}, call) is Seal.VALID  # not acted on: free
    for name in SEALED_HEADERS:
        assert b.check_seal({**headers, name: "forged"}, call) is Seal.INVALID, name
        assert b.check_seal({k: v for k, v in headers.items() if k != name}, call) is Seal.INVALID, name
    # A field a later release adds to a header's value is covered without naming it.
    verdict = {**headers["idemmail_verdict"], "new_field": 1}
    assert b.check_seal({**headers, "idemmail_verdict": verdict}, call) is Seal.INVALID
    assert b.check_seal(headers, b.payload(("eve@example.com", "receipt", 1), {})) is Seal.INVALID
    other_task = IntentKeyBuilder(task_name="app.other", signature=b.signature, secret="s")
    assert other_task.check_seal(headers, call) is Seal.INVALID
    assert b.check_seal({**headers, KEY_MARK_HEADER: "0" * 64}, call) is Seal.INVALID
    assert b.check_seal({k: v for k, v in headers.items() if k != KEY_MARK_HEADER}, call) is Seal.ABSENT


def test_a_seal_made_under_an_older_secret_verifies_and_one_under_a_newer_secret_is_told_apart() -> None:
    from idemmail_celery.chain import KEY_HEADER, KEY_MARK_HEADER
    from idemmail_celery.keys import Seal

    old, rotating = builder(secret="one"), builder(secret=["two", "one"])
    call = old.payload(("ann@example.com", "receipt", 1), {})
    by_old = {KEY_HEADER: "k", KEY_MARK_HEADER: old.seal({KEY_HEADER: "k"}, call)}
    by_new = {KEY_HEADER: "k", KEY_MARK_HEADER: rotating.seal({KEY_HEADER: "k"}, call)}
    assert rotating.check_seal(by_old, call) is Seal.VALID  # workers first: the older secret's seal
    assert old.check_seal(by_new, call) is Seal.UNKNOWN_SECRET  # web first: the worker waits
    assert builder(secret="three").check_seal(by_old, call) is Seal.UNKNOWN_SECRET
    assert "one" not in by_old[KEY_MARK_HEADER] and len(by_old[KEY_MARK_HEADER]) == 12 + 1 + 64
