"""OpenAI Predicted Outputs' ``prediction`` field as the gateway reads it: ``{"type":
"content", "content": <string or list of text parts>}``, and the bound on its length checked
before it is tokenized."""

from __future__ import annotations

from typing import Any

from specmesh.gateway.api_errors import bad_request

#: characters a prediction may have per token of max_model_len (refused before tokenizing:
#: a bound on the gateway's work; a token is rarely more than a few characters)
MAX_PREDICTION_CHARS_PER_TOKEN = 32


def prediction_text(p: Any) -> str | None:
    """The text of the ``prediction`` value ``p`` (text parts joined), None without one.

    Raises:
        GatewayError: 400 (param ``prediction``) for anything but ``{"type": "content",
            "content": <string or list of text parts>}``.
    """
    if p is None:
        return None
    if not isinstance(p, dict) or p.get("type") != "content" or "content" not in p:
        raise bad_request('prediction must be {"type": "content", "content": ...}',
                          param="prediction")
    extra = set(p) - {"type", "content"}
    if extra:
        raise bad_request(f"prediction has unknown fields {sorted(extra)}",
                          param="prediction")
    content = p["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request("prediction.content parts must be "
                                  '{"type": "text", "text": <string>}', param="prediction")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("prediction.content must be a string or a list of text parts",
                      param="prediction")
