"""A signed edge key travels through every hop unchanged, and only the originators' secret makes one."""

from __future__ import annotations

import pytest

import askonce
from askonce.core import signing
from askonce.core.question import Hop
from askonce.core.wire import Malformed, format_question, parse_question

SECRET = b"0123456789abcdef0123"


def _hop(headers: dict[str, str], layer: str) -> dict[str, str]:
    """One server that extracts the question and calls the next hop with it."""
    out: dict[str, str] = {}
    with askonce.serve(headers, layer=layer), askonce.outgoing(out) as call:
        call.answered(reply=askonce.Reply(0))
    return out


def test_a_signed_key_survives_three_hops_and_verifies_at_the_target() -> None:
    headers: dict[str, str] = {}
    with askonce.question(budget=2, secret=SECRET) as q, askonce.outgoing(headers) as call:
        call.answered(reply=askonce.Reply(2))
    assert q.sig == signing.mac(q.key, SECRET)
    for layer in ("gw", "api", "svc"):
        headers = _hop(headers, layer)
    arrived = askonce.propagation.extract(headers)
    assert arrived is not None and arrived.key == q.key
    assert signing.verify_key(arrived.key, arrived.sig, SECRET)
    assert signing.verify(headers["askonce-question"], SECRET)
    assert not signing.verify_key(arrived.key, arrived.sig, b"another-secret-of-16+b")


def test_without_a_secret_nothing_is_signed_and_a_forged_edge_does_not_verify() -> None:
    headers: dict[str, str] = {}
    with askonce.question(budget=2), askonce.outgoing(headers):
        pass
    arrived = askonce.propagation.extract(headers)
    assert arrived is not None and arrived.edge and arrived.sig is None
    assert not signing.verify_key(arrived.key, arrived.sig, SECRET)


def test_fanout_children_carry_no_signature() -> None:
    with askonce.question(budget=2, secret=SECRET), askonce.fanout("a") as child:
        assert child.sig is None


def test_an_originator_server_signs_what_it_mints() -> None:
    with askonce.serve({}, layer="web", originator=True, secret=SECRET) as serving:
        q = serving.tab.snapshot(())
    assert q.edge and signing.verify_key(q.key, q.sig, SECRET)


@pytest.mark.parametrize("sig", [b"x" * 65, b""])
def test_signature_bounds(sig: bytes) -> None:
    key = askonce.propagation.new_key()
    text = format_question(key, "edge", True, 1, None, (), None) + (", s=::" if not sig else "")
    if sig:
        import base64

        text += f", s=:{base64.b64encode(sig).decode()}:"
    assert parse_question(text, now=0.0) == Malformed("sig")


def test_signed_header_takes_the_fast_path_and_agrees_with_the_general_parser() -> None:
    from askonce.core import wire

    key = askonce.propagation.new_key()
    text = format_question(key, "edge", True, 1, 2.0, (Hop("edge", 1),), signing.mac(key, SECRET))
    fields = wire._canonical(text, 0.0, askonce.Limits())
    fast = None if fields is None else askonce.Question(*fields)
    assert fast is not None and fast == wire._parse_question_general(text, 0.0, askonce.Limits())
    assert fast.sig == signing.mac(key, SECRET)
