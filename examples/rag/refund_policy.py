"""Context for a RAG prompt from kb search, no LLM needed: publishes
examples/refund-policy/v1.md, waits until it is searchable, then retrieves through kb-client,
LangChain and LlamaIndex.

    kb serve & kb relay run & kb indexer run &      # or: kb demo
    export KB_URL=http://127.0.0.1:8080 KB_API_KEY=kb.acme....   # an admin or publish+search key
    uv run python examples/rag/refund_policy.py
"""

from __future__ import annotations

import os
from pathlib import Path

from kb_client import KbClient, Published
from kb_client.langchain import KbRetriever
from kb_client.llamaindex import KbLlamaRetriever

POLICY = Path(__file__).resolve().parents[1] / "refund-policy" / "v1.md"
QUESTION = "How long do I have to return an item?"
READ = ["group:all"]


def run(url: str, api_key: str) -> dict[str, list[str]]:
    """Each way's context for QUESTION: the heading path and text of each hit."""
    with KbClient(url, api_key) as kb:
        published: Published = kb.publish_file(POLICY, title="Refund policy", read=READ)
        print(f"searchable: {published.document_id} v{published.version_number}")

        hits = kb.search(QUESTION, principals=READ, top_k=3).results
        langchain_docs = KbRetriever(client=kb, principals=READ, top_k=3).invoke(QUESTION)
        llama_nodes = KbLlamaRetriever(client=kb, principals=READ, top_k=3).retrieve(QUESTION)
        return {
            "kb-client": [f"{' > '.join(h.heading_path)}: {h.text}" for h in hits],
            "langchain": [
                f"{' > '.join(d.metadata['heading_path'])}: {d.page_content}"
                for d in langchain_docs
            ],
            "llamaindex": [
                f"{' > '.join(n.node.metadata['heading_path'])}: {n.node.get_content()}"
                for n in llama_nodes
            ],
        }


def main() -> None:
    context = run(os.environ.get("KB_URL", "http://127.0.0.1:8080"), os.environ["KB_API_KEY"])
    for way, passages in context.items():
        print(f"\n## {way}")
        for passage in passages:
            print(f"- {passage[:160]}")


if __name__ == "__main__":
    main()
