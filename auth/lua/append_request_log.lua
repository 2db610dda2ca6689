-- append_request_log: add finished requests' records to the request log, index them by request id, and trim the
-- log to its retention and length cap, in one call per batch.
--
-- KEYS[1]  ug:{reqlog}:log        stream  one entry per request: field "r" = the record (JSON)
-- ARGV[1]  oldest entry time to keep (ms since the epoch): entries before it are trimmed (retention)
-- ARGV[2]  the most entries the log keeps (length cap; exact: each add past it drops the oldest)
-- ARGV[3]  the index hash of today: "ug:{reqlog}:ids:<days since the epoch>" (same hash tag as KEYS[1]: one slot)
-- ARGV[4]  when that hash expires (ms since the epoch): the end of its day plus the retention
-- ARGV[5], ARGV[6], ... pairs: request id, record JSON
--
-- Returns the number of records added. Entry ids are Redis' own (server time), so they increase across gateway
-- instances. The index is one hash a day, not a key per request (a SET with its own expiry per request cost Redis
-- ~4.5 us of its ~7.5 per record); a day's hash expires whole, a retention after its last record.

local log_key, index_key = KEYS[1], ARGV[3]
-- Trim first: a gateway whose clock runs ahead must not trim the records it is adding.
redis.call('XTRIM', log_key, 'MINID', ARGV[1])
local added = 0
local index = {}
for i = 5, #ARGV, 2 do
  index[#index + 1] = ARGV[i]
  index[#index + 1] = redis.call('XADD', log_key, 'MAXLEN', ARGV[2], '*', 'r', ARGV[i + 1])
  added = added + 1
end
if added > 0 then
  redis.call('HSET', index_key, unpack(index))  -- one command for the batch's index entries
  redis.call('PEXPIREAT', index_key, ARGV[4])
end
return added
