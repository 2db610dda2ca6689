-- Shared prelude, prepended by auth/scripts.py (after the clock, _clock.lua) to every script: UTC calendar days.
-- civil_from_days(days) -> year, month, day (proleptic Gregorian, H. Hinnant's algorithm).
-- days_from_civil(year, month, day) -> days since 1970-01-01.
-- period_of(budget_period, now_ms) -> period key ("" for "total", "d:YYYY-MM-DD", "m:YYYY-MM"), ms until it ends.

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function day_string(now)
  local y, m, d = civil_from_days(math.floor(now / 86400000))
  return string.format('%04d-%02d-%02d', y, m, d)
end

local function period_of(budget_period, now)
  local days = math.floor(now / 86400000)
  local y, m, d = civil_from_days(days)
  if budget_period == 'day' then
    return string.format('d:%04d-%02d-%02d', y, m, d), (days + 1) * 86400000 - now
  elseif budget_period == 'month' then
    local ny, nm = y, m + 1
    if nm > 12 then ny, nm = y + 1, 1 end
    return string.format('m:%04d-%02d', y, m), days_from_civil(ny, nm, 1) * 86400000 - now
  end
  return '', 0
end
