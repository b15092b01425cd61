"""URLs as gpufail shows them: what may be a credential masked, the service still named."""

import pytest

from ingest.urls import MASK, described_url, masked_url, redact_urls, url_fingerprint


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "https://hooks.slack.com/services/T0A1B2C3D/B0A1B2C3D/Xk29fLq8ZpR4",
            f"https://hooks.slack.com/services/{MASK}",
        ),
        ("https://discord.com/api/webhooks/1234567890/AbC-dEf_gh", f"https://discord.com/api/webhooks/{MASK}"),
        ("https://x.example/a1b2c3d4e5f6a7b8/notify", f"https://x.example/{MASK}"),
        ("http://mlflow:5000/?api_key=s3cr3t&team=ml", f"http://mlflow:5000/?api_key={MASK}&team={MASK}"),
        ("https://ml:pw@mlflow.internal:5000", f"https://ml:{MASK}@mlflow.internal:5000"),
        ("https://ghp_token@git.example/x", f"https://{MASK}@git.example/x"),
        ("https://h.example/a#access_token=abc", f"https://h.example/a#{MASK}"),
        ("http://[::1]:9090/api/v1/query_range", "http://[::1]:9090/api/v1/query_range"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("http://user:pw@[::1", MASK),  # does not parse
    ],
)
def test_a_url_keeps_its_service_and_loses_what_may_be_a_key(url, shown):
    assert masked_url(url) == shown


def test_a_described_url_has_a_fingerprint_only_when_something_was_hidden():
    hook = "https://hooks.slack.com/services/T0/B0/KEY123abc"
    assert described_url(hook) == f"https://hooks.slack.com/services/{MASK} ({url_fingerprint(hook)})"
    assert url_fingerprint(hook) != url_fingerprint(hook + "x") and "KEY123abc" not in url_fingerprint(hook)
    assert described_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_urls_in_a_message_are_masked_and_the_rest_left_alone():
    text = "webhook https://h.example/hook?token=abc: refused; data s3://bucket/x/2026 and http://127.0.0.1:5000."
    assert redact_urls(text) == (
        f"webhook https://h.example/hook?token={MASK}: refused; data s3://bucket/x/2026 and http://127.0.0.1:5000."
    )
