"""Signed edge keys: sign at the originator, verify at the target; a forged, altered or unsigned edge key fails."""

from __future__ import annotations

import base64

import pytest
from http_sfv.dictionary import Dictionary
from hypothesis import given
from hypothesis import strategies as st

from askonce.core import wire
from askonce.core.ledger import Ledger
from askonce.core.question import Hop
from askonce.core.signing import sign, sign_header, verify, verify_edge, verify_key

SECRET = b"0123456789abcdef0123"
OLD = "an older secret, rotated out"
KEY = "01JD5Q3W8M0S3V2T8QK6Y7C2BZ4E9R1N0HAF"
EDGE = wire.format_question(KEY, "edge", True, 2, 2.5, (Hop("edge", 1), Hop("gw", 2)))


def test_the_documented_example() -> None:
    assert sign_header(wire.format_question(KEY, "edge", True, 2, None), SECRET) == (
        'v=1, k="01JD5Q3W8M0S3V2T8QK6Y7C2BZ4E9R1N0HAF", o=edge, e, b=2, s=:NNwQzqBMp7v3FKj9+1pDOg==:')


def test_a_signed_edge_key_verifies_and_still_parses_everywhere() -> None:
    signed = sign_header(EDGE, SECRET)
    assert verify(signed, SECRET) and verify_edge(signed, SECRET)
    assert verify(signed.encode("ascii"), SECRET)
    parsed = wire.parse_question(signed, 0.0)  # version-1 parsers ignore the member
    assert not isinstance(parsed, wire.Malformed) and parsed.key == KEY and parsed.edge
    sfv = Dictionary()
    sfv.parse(signed.encode("ascii"))  # and it is a valid RFC 9651 dictionary
    assert sfv["s"].value == base64.b64decode(sign(KEY, SECRET))
    fields = wire.parse_dictionary(signed)
    assert not isinstance(fields, wire.Malformed) and verify(fields, SECRET)


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (EDGE, "unsigned"),
        (sign_header(EDGE, b"another secret, 16+ bytes"), "signed with another secret"),
        (sign_header(EDGE, SECRET).replace(KEY, KEY[:-1] + "X"), "the key was changed"),
        (EDGE + ", s=:" + base64.b64encode(b"\0" * 16).decode() + ":", "a made-up signature"),
        (EDGE + ", s=:" + base64.b64encode(b"\0" * 65).decode() + ":", "an oversized signature"),
        (EDGE + ', s="' + sign(KEY, SECRET) + '"', "the signature as a string, not bytes"),
        (sign_header(EDGE, SECRET) + ", s=1", "a duplicate member: malformed"),
        ("v=1, k=, nonsense", "malformed"),
        ("\u00e9", "not ASCII"),
    ],
)
def test_what_does_not_verify(header: str, why: str) -> None:
    assert not verify(header, SECRET), why
    assert not verify_edge(header, SECRET), why


def test_a_valid_signature_without_e_is_no_edge_key() -> None:
    plain = wire.format_question(KEY, "gw", False, 2, None)
    assert sign_header(plain, SECRET) == plain  # only edge keys are signed
    forged_down = plain + ", s=:" + sign(KEY, SECRET) + ":"
    assert verify(forged_down, SECRET) and not verify_edge(forged_down, SECRET)


def test_signing_twice_or_a_malformed_header_changes_nothing() -> None:
    signed = sign_header(EDGE, SECRET)
    assert sign_header(signed, SECRET) == signed
    assert sign_header("garbage(", SECRET) == "garbage("


def test_verify_key_for_a_parsed_question() -> None:
    sig = base64.b64decode(sign(KEY, SECRET))
    assert verify_key(KEY, sig, SECRET) and verify_key(KEY, sig, [OLD, SECRET])
    assert not verify_key(KEY, None, SECRET) and not verify_key(KEY + "x", sig, SECRET)
    assert not verify_key(KEY, sig + b"\0" * 60, SECRET)


def test_rotation_accepts_any_listed_secret() -> None:
    old = sign_header(EDGE, OLD)
    assert verify(old, [SECRET, OLD]) and verify(sign_header(EDGE, SECRET), [SECRET, OLD])
    assert not verify(old, [SECRET])


@pytest.mark.parametrize("secret", [b"short", "", [], [b"0123456789abcdef", b"x"]])
def test_weak_secrets_are_refused(secret: object) -> None:
    with pytest.raises(ValueError):
        verify(EDGE, secret)  # type: ignore[arg-type]
    if not isinstance(secret, list):
        with pytest.raises(ValueError):
            sign(KEY, secret)  # type: ignore[arg-type]


@given(st.text(alphabet="0123456789ABCDEFGHJKMNPQRSTVWXYZabcdefghijklmnopqrstuvwxyz_-", min_size=16, max_size=64))
def test_any_valid_key_round_trips_and_one_changed_character_fails(key: str) -> None:
    header = sign_header(wire.format_question(key, "edge", True, 1, None), SECRET)
    assert verify_edge(header, SECRET)
    other = ("A" if key[0] != "A" else "B") + key[1:]
    assert not verify_edge(header.replace(f'k="{key}"', f'k="{other}"'), SECRET)


def test_a_target_that_checks_signatures_counts_forged_edge_keys_as_reminted() -> None:
    ledger = Ledger()
    arrivals = [sign_header(EDGE, SECRET), EDGE.replace(KEY, "forged-by-a-client-0001")]
    for header in arrivals:
        q = wire.parse_question(header, 0.0)
        assert not isinstance(q, wire.Malformed)
        ledger.record(1.0, "op", key=q.key, edge=verify_edge(header, SECRET), origin=q.origin,
                      path=tuple(q.path))
    got = ledger.report(1.0).find("op")
    assert got is not None and got.coverage == 0.5 and dict(got.reminted_by) == {"edge": 1}
