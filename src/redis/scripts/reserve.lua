-- reserve: holds `count` free items for one owner, all or nothing, and records the reservation.
-- KEYS: none (every key is built from ARGV[1], the pool's key base with its {hash tag})
-- ARGV: 1 base, 2 rid, 3 owner, 4 count, 5 ttlMs, 6 maxHoldsPerOwner (0 = none), 7 kind ("r"|"l"),
--       8 retentionMs, 9 idempotency key ("" = none), 10 body hash, 11 idempotency ttlMs,
--       12 attribute filter as JSON object ("" = none), 13 value prefix ("" = none), 14 group affinity ("1"|"0"),
--       15 grace ms (the holds outlive expiresAt by this much; the sweeper looks at the reservation then)
-- Returns: {"ok"|"replay", rid, state, owner, kind, createdMs, expiresMs, itemsJson, outcomeJson, nowMs}
--          or {"exhausted"} | {"quota", heldNow} | {"reused"}
local base, rid, owner = ARGV[1], ARGV[2], ARGV[3]
local count, ttl, max_holds = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local kind, retention = ARGV[7], tonumber(ARGV[8])
local idem_key, body_hash, idem_ttl = ARGV[9], ARGV[10], tonumber(ARGV[11])
local attr_json, prefix, affinity, grace = ARGV[12], ARGV[13], ARGV[14] == '1', tonumber(ARGV[15])
local now = now_ms()

if idem_key ~= '' then
  local prev = redis.call('GET', base .. 'idem:' .. idem_key)
  if prev then
    local sep = string.find(prev, '\n', 1, true)
    if string.sub(prev, sep + 1) ~= body_hash then return { 'reused' } end
    local prid = string.sub(prev, 1, sep - 1)
    local prkey = base .. 'r:' .. prid
    if redis.call('EXISTS', prkey) == 1 then return reservation_reply('replay', prid, prkey, now) end
  end
end

if max_holds > 0 then
  local held = tonumber(redis.call('HGET', base .. 'oh', owner) or '0')
  if held + count > max_holds then return { 'quota', tostring(held) } end
end

-- No generation key: Redis was wiped and this pool is not rebuilt yet (the rebuild writes the key
-- before it adds any item). Nothing may be held until then.
local generation = redis.call('GET', base .. 'gen')
if not generation then return { 'exhausted' } end

local free = base .. 'free'
local hold_ms = ttl + grace
local want = attr_json ~= '' and cjson.decode(attr_json) or {}
local chosen, seen = {}, {}

-- True when the item's value starts with the filter's prefix and it has every attribute pair the filter names.
local function matches(item)
  if prefix ~= '' and string.sub(item.v, 1, #prefix) ~= prefix then return false end
  for k, v in pairs(want) do
    if type(item.a) ~= 'table' or item.a[k] ~= v then return false end
  end
  return true
end

-- Holds a candidate member and takes it out of the free index if it is still free, unheld and what the filter
-- asks for (the hold's SET NX is the check for "unheld"); repairs the index if not. `source` is the set the
-- candidate came from, cleaned as well when the candidate is stale.
local function consider(m, source)
  if #chosen >= count then return end
  if seen[m] then
    -- Considered before and still listed where it was found. Every entry considered leaves the index, or the
    -- sets that list it wrongly, so this is only a safety net: drop it, so that the picking loops always end.
    redis.call('ZREM', free, m)
    if source then redis.call('SREM', source, m) end
    return
  end
  seen[m] = true
  local id = id_of(m)
  local json = item_get(base, id)
  local item = json and cjson.decode(json)
  local own = item and member_of(item) == m
  if item and not own then
    -- An entry naming another value than its item's: drop it, and index the item under its own entry if it
    -- is unheld (a later pick may find it there).
    redis.call('ZREM', free, m)
    if source then redis.call('SREM', source, m) end
    if redis.call('EXISTS', base .. 'h:' .. id) == 0 then index(base, item) end
    return
  end
  if own and not matches(item) then
    -- Listed in an attribute set whose pair the item does not have: drop it from the sets that are wrong.
    for k, v in pairs(want) do
      if type(item.a) ~= 'table' or item.a[k] ~= v then redis.call('SREM', attr_key(base, k, v), m) end
    end
    return
  end
  if not item or not redis.call('SET', base .. 'h:' .. id, rid, 'PX', hold_ms, 'NX') then
    -- An index entry without a free, unheld item behind it: drop it.
    redis.call('ZREM', free, m)
    if source then redis.call('SREM', source, m) end
    return
  end
  unindex(base, item, m)
  chosen[#chosen + 1] = { json = json, item = item }
end

if attr_json ~= '' then
  local keys = {}
  for k, v in pairs(want) do keys[#keys + 1] = attr_key(base, k, v) end
  if #keys == 1 and prefix == '' then
    -- Random picks; stale entries are removed as they are met, so this converges.
    while #chosen < count do
      local picks = redis.call('SRANDMEMBER', keys[1], count - #chosen)
      if #picks == 0 then break end
      for _, m in ipairs(picks) do consider(m, keys[1]) end
    end
  else
    -- Several conditions. With attributes alone, Redis counts their intersection first (in C, stopping at
    -- INTERSECTION_READ): fewer than `count` is an answer at once (stale entries only add to the count), and an
    -- intersection smaller than the cap is read whole. Otherwise, and with a prefix: walk the smallest of the
    -- sets the conditions name, or the prefix's range of the free index, a page at a time; check the other
    -- conditions member by member; stop once `count` are held. No call copies a whole set.
    local INTERSECTION_READ = 256
    local intersection = -1
    if prefix == '' then
      local args = { 'SINTERCARD', #keys }
      for _, key in ipairs(keys) do args[#args + 1] = key end
      args[#args + 1], args[#args + 2] = 'LIMIT', INTERSECTION_READ
      intersection = redis.call(unpack(args))
    end
    if intersection >= 0 and intersection < INTERSECTION_READ then
      if intersection >= count then
        for _, m in ipairs(redis.call('SINTER', unpack(keys))) do
          if #chosen >= count then break end
          consider(m, keys[1])
        end
      end
    else
      local walk, smallest = 0, nil
      if prefix ~= '' then smallest = redis.call('ZLEXCOUNT', free, '[' .. prefix, '(' .. prefix .. '\255') end
      for i, key in ipairs(keys) do
        local n = redis.call('SCARD', key)
        if not smallest or n < smallest then walk, smallest = i, n end
      end
      -- Pages start at a few times what is wanted and double up to 100 members.
      local page_size = math.min(100, 4 * count)
      local function next_page_size()
        local n = page_size
        page_size = math.min(100, 2 * page_size)
        return n
      end
      local function passes(m)
        if prefix ~= '' and string.sub(m, 1, #prefix) ~= prefix then return false end
        for i, key in ipairs(keys) do
          if i ~= walk and redis.call('SISMEMBER', key, m) == 0 then return false end
        end
        return true
      end
      if walk == 0 then
        -- By value, from the prefix on; the next page starts after the last member read (members taken or
        -- dropped meanwhile do not shift it).
        local from, to = '[' .. prefix, '(' .. prefix .. '\255'
        while #chosen < count do
          local page = redis.call('ZRANGEBYLEX', free, from, to, 'LIMIT', 0, next_page_size())
          if #page == 0 then break end
          for _, m in ipairs(page) do
            if #chosen >= count then break end
            if passes(m) then consider(m, keys[1]) end
          end
          from = '(' .. page[#page]
        end
      else
        local cursor = '0'
        repeat
          local scan = redis.call('SSCAN', keys[walk], cursor, 'COUNT', next_page_size())
          cursor = scan[1]
          for _, m in ipairs(scan[2]) do
            if #chosen >= count then break end
            if passes(m) then consider(m, keys[walk]) end
          end
        until cursor == '0' or #chosen >= count
      end
    end
  end
elseif prefix ~= '' then
  -- Members sort by value, so the items with this prefix form one lex range. UTF-8 never holds byte 0xFF.
  -- Every member considered leaves the index, so the next page starts at offset 0 again.
  while #chosen < count do
    local page = redis.call('ZRANGEBYLEX', free, '[' .. prefix, '(' .. prefix .. '\255', 'LIMIT', 0, count - #chosen)
    if #page == 0 then break end
    for _, m in ipairs(page) do consider(m) end
  end
else
  if affinity then
    -- A reviewer gets a task from a group it already leases in before any other group.
    local groups = redis.call('HKEYS', base .. 'og:' .. owner)
    for _, g in ipairs(groups) do
      if #chosen >= count then break end
      local group = base .. 'fg:' .. g
      for _, m in ipairs(redis.call('SRANDMEMBER', group, count)) do consider(m, group) end
    end
  end
  while #chosen < count do
    local picks = redis.call('ZRANDMEMBER', free, count - #chosen)
    if #picks == 0 then break end
    for _, m in ipairs(picks) do consider(m) end
  end
end

local items, jsons = {}, {}
for i, c in ipairs(chosen) do
  items[i] = c.item
  jsons[i] = c.json
end

if #chosen < count then
  -- All or nothing: give back what was taken.
  for _, item in ipairs(items) do redis.call('DEL', base .. 'h:' .. item.id) end
  index_all(base, items)
  return { 'exhausted' }
end

local rkey = base .. 'r:' .. rid
local r = { o = owner, k = kind, s = 'held', i = '[' .. table.concat(jsons, ',') .. ']', c = tostring(now),
  e = tostring(now + ttl), cnt = '1', g = generation }
redis.call('HSET', rkey, 'o', r.o, 'k', r.k, 's', r.s, 'i', r.i, 'c', r.c, 'e', r.e, 'cnt', r.cnt, 'g', r.g)
redis.call('PEXPIRE', rkey, hold_ms + retention)
redis.call('ZADD', base .. 'exp', now + hold_ms, rid)
count_items(base, owner, kind, items, 1)
if idem_key ~= '' then
  redis.call('SET', base .. 'idem:' .. idem_key, rid .. '\n' .. body_hash, 'PX', idem_ttl)
end
return reply_of('ok', rid, r, now)
