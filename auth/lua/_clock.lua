-- Shared prelude, prepended by auth/scripts.py to every script: the clock.
-- now_ms(): milliseconds since the epoch from Redis TIME (one clock for every gateway instance). Tests swap this
-- file for a clock read from a key (auth/scripts.py `ScriptSet(clock_key=...)`).

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
