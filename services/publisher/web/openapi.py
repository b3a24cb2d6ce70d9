"""The committed OpenAPI document (``services/publisher/web/openapi.json``).

Regenerate it after an API change with ``python -m services.publisher.web.openapi``; a test
fails while the committed file and the app's schema differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.publisher.settings import PublisherSettings
from services.publisher.web.api import create_app

OPENAPI_PATH = Path(__file__).resolve().parent / "openapi.json"


def generate() -> dict[str, Any]:
    # Fixed settings: the document must not depend on the environment it is generated in.
    settings = PublisherSettings(database_url="postgresql://unused/kb")
    schema: dict[str, Any] = create_app(settings).openapi()
    return schema


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main() -> None:
    OPENAPI_PATH.write_text(render(generate()), encoding="utf-8")
    print(OPENAPI_PATH)


if __name__ == "__main__":
    main()
