import type { Redis } from 'ioredis';

// One atomic snapshot of a pool's holds (a script runs alone in Redis): for every reservation that is
// held or committing, the items whose hold key names it; every item a reservation still due (held, before its
// expiresAt) lists but does not hold; and the ids in the free index. A hold key names one reservation, so two
// live holds on one item show as a due reservation whose item is held by another, or by nobody.
const SNAPSHOT = `
local base = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held, lost = {}, {}
for _, key in ipairs(redis.call('KEYS', base .. 'r:*')) do
  local f = redis.call('HMGET', key, 's', 'i', 'e')
  if f[1] == 'held' or f[1] == 'confirming' then
    local rid = string.sub(key, #base + 3)
    local due = f[1] == 'held' and tonumber(f[3]) > now
    for _, item in ipairs(cjson.decode(f[2])) do
      local holder = redis.call('GET', base .. 'h:' .. item.id)
      if holder == rid then held[#held + 1] = item.id .. ' ' .. rid
      elseif due then lost[#lost + 1] = item.id .. ' ' .. rid .. ' ' .. tostring(holder) end
    end
  end
end
return { held, redis.call('ZRANGE', base .. 'free', 0, -1), lost }`;

/**
 * Live holds of the pool whose key base is `base`: item id -> the reservation holding it; the free item ids; and
 * "<item> <reservation> <its holder>" for each item that a reservation still due lists and does not hold.
 */
export async function holdSnapshot(redis: Redis, base: string): Promise<{ holders: Map<string, string>; free: string[]; lost: string[] }> {
  const [held, free, lost] = (await redis.eval(SNAPSHOT, 0, base)) as [string[], string[], string[]];
  const holders = new Map(held.map((entry) => entry.split(' ') as [string, string]));
  return { holders, free: free.map((m) => m.slice(m.lastIndexOf('\0') + 1)), lost };
}
