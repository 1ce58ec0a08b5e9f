-- read: one reservation as stored, with the Redis clock.
-- ARGV: 1 base, 2 rid
-- Returns: {"ok", rid, state, owner, kind, createdMs, expiresMs, itemsJson, outcomeJson, nowMs} or {"missing"}
local base, rid = ARGV[1], ARGV[2]
local rkey = base .. 'r:' .. rid
if redis.call('EXISTS', rkey) == 0 then return { 'missing' } end
return reservation_reply('ok', rid, rkey, now_ms())
