-- unpin: a commit attempt failed before reaching Postgres' decision (Postgres unreachable, a timeout):
-- the reservation is held again until its own expiry, as if the confirm had never come, so the caller
-- can retry. Only while the hold has not expired and only for the epoch that failed. The holds stay
-- pinned: the commit may have landed unseen, so they end only when the sweeper has asked Postgres
-- (at expiry, the reservation having an epoch).
-- ARGV: 1 base, 2 rid, 3 epoch
-- Returns: 1 if the reservation is held again, 0 if it was left for the sweeper to settle
local base, rid, epoch = ARGV[1], ARGV[2], ARGV[3]
local rkey = base .. 'r:' .. rid
local f = redis.call('HMGET', rkey, 's', 'e', 'ep')
local now = now_ms()
if f[1] ~= 'confirming' or f[3] ~= epoch then return 0 end
local expires = tonumber(f[2])
if expires <= now then return 0 end
redis.call('HSET', rkey, 's', 'held')
redis.call('ZADD', base .. 'exp', expires, rid)
return 1
