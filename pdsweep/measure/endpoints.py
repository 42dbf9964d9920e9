"""URLs of the OpenAI-compatible API that vLLM and the PD proxy serve. A leaf: the
accuracy stage (lm-eval's ``base_url``), the consistency probe and the probe loop of
``measure`` all build their URLs here."""

from __future__ import annotations


def completions_url(base_url: str, chat: bool = False) -> str:
    """Full endpoint URL: a URL ending in ``/completions`` is kept (``/v1/completions``
    becomes ``/v1/chat/completions`` when ``chat``); a server root or ``.../v1`` gets the
    path appended."""
    url = base_url.rstrip("/")
    path = "/chat/completions" if chat else "/completions"
    if url.endswith("/chat/completions"):
        return url if chat else url[: -len("/chat/completions")] + path
    if url.endswith("/completions"):
        return url[: -len("/completions")] + path
    return (url if url.endswith("/v1") else url + "/v1") + path
