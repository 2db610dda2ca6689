-- append_request_log: add finished requests' records to the request log, index them by request id, and trim the
-- log to its retention and length cap, in one call per batch.
--
-- KEYS[1]  ug:{reqlog}:log        stream  one entry per request: field "r" = the record (JSON), plus the fields
--                                         listings filter on without parsing: "k" key id, "t" team id, "m" model
-- ARGV[1]  oldest entry time to keep (ms since the epoch): entries before it are trimmed (retention)
-- ARGV[2]  the most entries the log keeps (length cap; exact: each add past it drops the oldest)
-- ARGV[3]  how long a request id's index entry lives (ms; the retention)
-- ARGV[4]  the index prefix "ug:{reqlog}:id:" (same hash tag as KEYS[1]: one cluster slot)
-- ARGV[5], ARGV[6], ... groups of five: request id, record JSON, key id, team id, model
--
-- Returns the number of records added. Entry ids are Redis' own (server time), so they increase across gateway
-- instances; the index maps a request id to its entry id and expires with the retention.

local log_key = KEYS[1]
local min_ms, max_len, ttl_ms, index_prefix = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
-- Trim first: a gateway whose clock runs ahead must not trim the records it is adding.
redis.call('XTRIM', log_key, 'MINID', min_ms)
local added = 0
for i = 5, #ARGV, 5 do
  local entry_id = redis.call('XADD', log_key, 'MAXLEN', max_len, '*',
    'r', ARGV[i + 1], 'k', ARGV[i + 2], 't', ARGV[i + 3], 'm', ARGV[i + 4])
  redis.call('SET', index_prefix .. ARGV[i], entry_id, 'PX', ttl_ms)
  added = added + 1
end
return added
