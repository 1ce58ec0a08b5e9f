-- extend: extend a live reservation or heartbeat a lease: expiresAt = now + ttl.
-- ARGV: 1 base, 2 rid, 3 ttl ms (already capped by the pool's maxHoldTtlMs), 4 retention ms, 5 grace ms (see reserve)
-- Returns: {"extended", ...reservation} | {"expired"} | {"closed"} | {"missing"}
local base, rid, ttl, retention, grace = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local rkey = base .. 'r:' .. rid
local f = redis.call('HMGET', rkey, 's', 'e', 'i', 'ep')
local now = now_ms()
if not f[1] then return { 'missing' } end
if f[1] == 'expired' or (f[1] == 'held' and tonumber(f[2]) <= now) then return { 'expired' } end
if f[1] ~= 'held' then return { 'closed' } end
local pinned = f[4] ~= false
for _, item in ipairs(decode_items(f[3])) do
  local hkey = base .. 'h:' .. item.id
  if redis.call('GET', hkey) ~= rid then return { 'expired' } end
  -- Holds of a reservation that started a commit last until the sweeper settles it: never shortened.
  if not pinned or tonumber(redis.call('PTTL', hkey)) < ttl + grace then redis.call('PEXPIRE', hkey, ttl + grace) end
end
redis.call('HSET', rkey, 'e', now + ttl)
redis.call('ZADD', base .. 'exp', now + ttl + grace, rid)
redis.call('PEXPIRE', rkey, ttl + grace + retention)
return reservation_reply('extended', rid, rkey, now)
