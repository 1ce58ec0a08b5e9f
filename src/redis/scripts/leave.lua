-- leave: a waiter that gives up leaves its waiting line (reserve.lua, `line`): its member out of the order and its place
-- at once (one without the other is passed over). Items may have been kept for it, while its place was live, from the
-- waiters behind it: if there are any and the pool is waited in (<base>ww), it says so on the pool's channel,
-- `left <line> <count>` (WakeUps), for them to try again at once. Run twice, the second run finds no place and says
-- nothing.
-- ARGV: 1 base, 2 the line, 3 the member ("<count> <rid>")
-- Returns: 1
local base, line, member = ARGV[1], ARGV[2], ARGV[3]
local queue, places = base .. 'wq:' .. line, base .. 'wl:' .. line
local place, rank = redis.call('ZSCORE', places, member), redis.call('ZRANK', queue, member)
redis.call('ZREM', queue, member)
redis.call('ZREM', places, member)
if place and rank and tonumber(place) > now_ms() and redis.call('ZCARD', queue) > rank and waited_in(base) then
  redis.pcall('PUBLISH', base .. 'freed', 'left ' .. line .. ' ' .. string.match(member, '^(%d+) '))
end
return 1
