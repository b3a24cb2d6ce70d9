"""Names and DDL of the ANN indexes: what goes into SQL text is checked, never user input."""

from __future__ import annotations

import pytest

from services.index.ann import (
    ann_index_name,
    create_tenant_ann_index_sql,
    drop_tenant_ann_index_sql,
    tenant_ann_index_name,
)

MODEL = "all-MiniLM-L6-v2-onnx-int8"
LONGEST_TENANT = "a" * 63


def test_a_tenant_graph_is_named_after_its_model_and_tenant_within_an_identifier() -> None:
    name = tenant_ann_index_name(MODEL, "acme")
    assert name.startswith(ann_index_name(MODEL) + "_t")
    assert name == tenant_ann_index_name(MODEL, "acme")
    assert name != tenant_ann_index_name(MODEL, "acme-2")
    assert name != tenant_ann_index_name("other-model", "acme")
    # PostgreSQL truncates identifiers beyond 63 bytes: two tenants would share one index.
    assert len(tenant_ann_index_name(MODEL, LONGEST_TENANT)) <= 63


@pytest.mark.parametrize(
    "tenant",
    ["Acme", "acme'; DROP TABLE knowledge_chunk; --", "", "-acme", "a" * 64, "acmé", "acme\n"],
)
def test_a_tenant_id_the_publisher_would_refuse_never_reaches_ddl(tenant: str) -> None:
    with pytest.raises(ValueError, match="not a tenant id"):
        tenant_ann_index_name(MODEL, tenant)
    with pytest.raises(ValueError, match="not a tenant id"):
        create_tenant_ann_index_sql(MODEL, 384, "knowledge_chunk_p07", tenant)


def test_a_tenant_graph_is_a_partial_index_of_its_partition_built_concurrently() -> None:
    sql = create_tenant_ann_index_sql(MODEL, 384, "knowledge_chunk_p07", "acme")
    assert sql == (
        f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {tenant_ann_index_name(MODEL, 'acme')}"
        " ON knowledge_chunk_p07 USING hnsw ((embedding::vector(384)) vector_cosine_ops)"
        f" WHERE embedding_model = '{MODEL}' AND tenant_id = 'acme'"
    )
    assert drop_tenant_ann_index_sql(MODEL, "acme") == (
        f"DROP INDEX CONCURRENTLY IF EXISTS {tenant_ann_index_name(MODEL, 'acme')}"
    )


def test_a_tenant_graph_goes_only_on_a_partition_of_knowledge_chunk() -> None:
    with pytest.raises(ValueError, match="not a partition"):
        create_tenant_ann_index_sql(MODEL, 384, "document_acl", "acme")


def test_a_model_or_partition_name_with_a_trailing_newline_never_reaches_ddl() -> None:
    # "$" matches before a final newline: the names must match whole.
    with pytest.raises(ValueError, match="characters outside"):
        tenant_ann_index_name(MODEL + "\n", "acme")
    with pytest.raises(ValueError, match="not a partition"):
        create_tenant_ann_index_sql(MODEL, 384, "knowledge_chunk_p07\n", "acme")
