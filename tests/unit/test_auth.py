"""The API key check both front doors (HTTP and gRPC) share."""

from __future__ import annotations

from tessera.cluster.auth import bearer, expected_authorization, key_matches


def test_a_request_must_present_bearer_and_the_key():
    expected = expected_authorization("s3cret")
    assert expected == b"Bearer s3cret"
    assert key_matches(expected, bearer("s3cret"))
    assert not key_matches(expected, "s3cret")  # the scheme is part of the value
    assert not key_matches(expected, "Bearer s3cre")
    assert not key_matches(expected, "Bearer s3cret ")
    assert not key_matches(expected, "Bearer sécret")  # non-ASCII: refused, no error


def test_no_key_means_open_access():
    assert expected_authorization(None) is None
    assert expected_authorization("") is None
