-- Admission control (docs/LIMITS.md) records its outcomes as decisions rows whose rule starts
-- with 'admission.' and whose detail JSON holds the inputs. This view lifts those inputs into
-- columns so that "who was throttled and why" and "usage against limits" are plain queries.
-- A view only: nothing is stored, so recreating it is always safe.

CREATE VIEW admission_decisions AS
SELECT
    d.id,
    d.run_id,
    d.at,
    strftime('%Y-%m-%d %H:%M:%f', d.at, 'unixepoch') AS at_utc,
    d.program_id,
    d.action,                                          -- admit | queue | reject | fallback |
                                                       -- refund | overage
    d.rule,
    json_extract(d.detail, '$.model') AS model,
    json_extract(d.detail, '$.class') AS class,
    json_extract(d.detail, '$.instance') AS instance,
    json_extract(d.detail, '$.share') AS share,
    json_extract(d.detail, '$.dimension') AS dimension,
    json_extract(d.detail, '$.window_s') AS window_s,
    json_extract(d.detail, '$.window_start') AS window_start,
    json_extract(d.detail, '$.limit') AS limit_value,
    json_extract(d.detail, '$.used') AS used,
    d.program_tokens AS reserved_tokens,
    json_extract(d.detail, '$.tokens') AS settled_tokens,
    json_extract(d.detail, '$.limits.rpm') AS rpm_limit,
    json_extract(d.detail, '$.limits.tpm') AS tpm_limit,
    json_extract(d.detail, '$.to') AS fallback_to,
    json_extract(d.detail, '$.why') AS why,
    d.waited_s,
    d.queue_position
FROM decisions AS d
WHERE d.rule LIKE 'admission.%';
