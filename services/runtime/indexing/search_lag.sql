-- name: search_lag
-- Documents whose search version lags their published version (docs/architecture.md#observability), and how long
-- the oldest has lagged (since its publish). $1 now. Reads every published document: run it
-- from one sampler per process every several seconds, not per request.
SELECT count(*) AS lagging,
       extract(epoch FROM coalesce($1::timestamptz, now()) - min(d.published_at))::float8
           AS oldest_lag_seconds
  FROM document d
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
 WHERE d.published_version IS NOT NULL
   AND (s.version_number IS NULL OR s.version_number < d.published_version)
