-- append_request_log: add finished requests' records to the request log, index them by request id, and trim the
-- log to its retention and length cap, in one call per batch.
--
-- KEYS[1]  ug:{reqlog}:log        stream  one entry per request: field "r" = the record (JSON)
-- ARGV[1]  oldest entry time to keep (ms since the epoch): entries before it are trimmed (retention)
-- ARGV[2]  the most entries the log keeps (length cap; exact: each add past it drops the oldest)
-- ARGV[3]  the index hash of today: "ug:{reqlog}:ids:<days since the epoch>" (same hash tag as KEYS[1]: one slot)
-- ARGV[4]  when that hash expires (ms since the epoch): the end of its day plus the retention
-- ARGV[5]  the batch's request ids, each followed by "\n"
-- ARGV[6]  their records (JSON), in the same order, each followed by "\n"
--
-- A batch is two strings, not two arguments a record: the client's encoding of ~400 arguments cost it more than
-- the records' JSON did. Neither holds a raw newline (request ids are [A-Za-z0-9._:-], JSON escapes it).
-- Returns the number of records added. Entry ids are Redis' own (server time), so they increase across gateway
-- instances. The index is one hash a day, not a key per request (a SET with its own expiry per request cost Redis
-- ~4.5 us of its ~7.5 per record); a day's hash expires whole, a retention after its last record.

local log_key, index_key = KEYS[1], ARGV[3]
-- Trim first: a gateway whose clock runs ahead must not trim the records it is adding.
redis.call('XTRIM', log_key, 'MINID', ARGV[1])
local function lines(text)
  local out, at = {}, 1
  while at <= #text do
    local stop = string.find(text, '\n', at, true)
    if not stop then break end
    out[#out + 1] = string.sub(text, at, stop - 1)
    at = stop + 1
  end
  return out
end
local ids, records = lines(ARGV[5] or ''), lines(ARGV[6] or '')
if #ids ~= #records then  -- checked before anything is written: a bad batch adds nothing
  return redis.error_reply('append_request_log: ids and records differ in number')
end
local added = 0
local index = {}
for i = 1, #ids do
  index[#index + 1] = ids[i]
  index[#index + 1] = redis.call('XADD', log_key, 'MAXLEN', ARGV[2], '*', 'r', records[i])
  added = added + 1
end
if added > 0 then
  redis.call('HSET', index_key, unpack(index))  -- one command for the batch's index entries
  redis.call('PEXPIREAT', index_key, ARGV[4])
end
return added
