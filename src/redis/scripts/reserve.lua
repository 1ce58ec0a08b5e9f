-- reserve: holds `count` free items for one owner, all or nothing, and records the reservation.
-- KEYS: none (every key is built from ARGV[1], the pool's key base with its {hash tag})
-- ARGV: 1 base, 2 rid, 3 owner, 4 count, 5 ttlMs, 6 maxHoldsPerOwner (0 = none), 7 kind ("r"|"l"),
--       8 how long the record outlives its hold, ms (a sweep closes it before), 9 idempotency key ("" = none),
--       10 body hash, 11 idempotency ttlMs,
--       12 attribute filter as JSON object ("" = none), 13 value prefix ("" = none), 14 group affinity ("1"|"0"),
--       15 grace ms (the holds outlive expiresAt by this much; the sweeper looks at the reservation then),
--       16 the waiting line this reserve, which waits (waitMs), takes its turn in ("" = none; see below), 17 how long
--       a waiter keeps its place without a try, ms, 18 "1" if this reserve waits (waitMs), in a line or not, and is
--       to be woken when items come free (WAIT_WAKE_UPS), 19 the id of a reservation the Idempotency-Key may be taken
--       from though it names it ("" = none; see "landed" below)
-- Returns: {"ok"|"replay", rid, state, owner, kind, createdMs, expiresMs, itemsJson, outcomeJson, nowMs}
--          or {"landed", prid}: the Idempotency-Key names a reservation (prid) whose record Redis no longer has (a
--          rebuild after a wipe put the keys of confirmed reservations back, RebuildService): the caller answers from
--          its Postgres commit, or, if there is none, sends the reserve again with ARGV 19 = prid to make a new one
--          or {"exhausted"} | {"exhausted", "limited"} (a filtered walk stopped at MAX_LOOKUPS) | {"quota", heldNow}
--          | {"reused"}; for a waiter, {"exhausted", "line", a, s} or {"exhausted", "waiters", n, a, s} (enough would be
--          free but for the n waiters before it they are kept for), a = live waiters ahead of it, s = the matching free
--          items (index entries) those waiters leave, which may serve smaller waiters behind it
local base, rid, owner = ARGV[1], ARGV[2], ARGV[3]
local count, ttl, max_holds = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local kind, open_record_ms = ARGV[7], tonumber(ARGV[8])
local idem_key, body_hash, idem_ttl = ARGV[9], ARGV[10], tonumber(ARGV[11])
local attr_json, prefix, affinity, grace = ARGV[12], ARGV[13], ARGV[14] == '1', tonumber(ARGV[15])
local line, place_ms, waits = ARGV[16] or '', tonumber(ARGV[17] or '0'), ARGV[18] == '1'
local forgotten = ARGV[19] or ''
local now = now_ms()

-- The answer of a try that found too few: a reserve that waits (and is to be woken) marks the pool as waited in for as
-- long as its place lasts, and the scripts that free items in it then say which (wake_waiters). A waiter tries at
-- least every 375 ms (ReservationsService), within that time.
local function too_few(reply)
  if waits then redis.call('SET', base .. 'ww', '1', 'PX', place_ms) end
  return reply
end
local MAX_REQUESTERS = 32

-- A record under this id already: the reserve was undone before it arrived (release.lua), as its caller got no
-- answer. It holds nothing.
if redis.call('EXISTS', base .. 'r:' .. rid) == 1 then return { 'exhausted' } end

if idem_key ~= '' then
  local prev = redis.call('GET', base .. 'idem:' .. idem_key)
  if prev then
    local sep = string.find(prev, '\n', 1, true)
    if string.sub(prev, sep + 1) ~= body_hash then return { 'reused' } end
    local prid = string.sub(prev, 1, sep - 1)
    local prkey = base .. 'r:' .. prid
    if redis.call('HEXISTS', prkey, 's') == 1 then
      -- This request may be answered with it now: the undo of every other request answered with it must keep it
      -- (release.lua, `rq`: the requests that may have it; absent, only the one that made it). A list of
      -- MAX_REQUESTERS becomes "*", which no undo empties: a client retrying without end would otherwise grow the
      -- record, and the time each replay holds Redis, without bound. The reservation then just expires.
      local rq = redis.call('HGET', prkey, 'rq') or prid
      if rq ~= '*' then
        local _, listed = string.gsub(rq, '%S+', '')
        redis.call('HSET', prkey, 'rq', listed >= MAX_REQUESTERS and '*' or (rq .. ' ' .. rid))
      end
      return reservation_reply('replay', prid, prkey, now)
    end
    if prid ~= forgotten then return { 'landed', prid } end
  end
end

-- The owner's reservations past their expiresAt that the sweep has not closed yet (it looks HOLD_GRACE_MS later, to
-- let a confirm that came in time reach Redis): the API calls them expired, so neither the quota nor a lease's group
-- counts them. Looked for among the pool's due expiries (the first LAPSED_LOOKUPS), and only when the counters alone
-- would refuse the quota or steer the pick. Not those with a commit undecided (still counted until it is settled).
-- Returns how many items they count, and how many of those in each group. (Made only for a reserve that may need it:
-- a closure costs every call that makes it.)
local LAPSED_LOOKUPS, lapsed = 64, nil
if max_holds > 0 or affinity then
  lapsed = function()
    local n, groups = 0, {}
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', base .. 'exp', '-inf', now + grace + 1, 'LIMIT', 0, LAPSED_LOOKUPS)) do
      local f = redis.call('HMGET', base .. 'r:' .. id, 'o', 's', 'e', 'cnt', 'ep', 'ad', 'i', 'k')
      if f[1] == owner and f[2] == 'held' and f[4] == '1' and tonumber(f[3]) <= now and (not f[5] or f[6] == f[5]) then
        -- As the sweep counts them (decode_items_safely, not named here: each helper a script names costs it a closure
        -- on every call): every element of a list, in a group if it names one.
        local ok, list = pcall(cjson.decode, f[7])
        for _, item in ipairs(ok and type(list) == 'table' and list or {}) do
          n = n + 1
          if f[8] == 'l' and type(item) == 'table' and has_group(item) then groups[item.g] = (groups[item.g] or 0) + 1 end
        end
      end
    end
    return n, groups
  end
end

if max_holds > 0 then
  local held = tonumber(redis.call('HGET', base .. 'oh', owner) or '0')
  if held + count > max_holds then
    held = held - lapsed()
    if held + count > max_holds then return { 'quota', tostring(held) } end
  end
end

-- No generation key: Redis was wiped and this pool is not rebuilt yet (the rebuild writes the key
-- before it adds any item), or the pool is being created (its key pending, see set_generation). Nothing may be held
-- until then.
local generation = redis.call('GET', base .. 'gen')
if not tonumber(generation) then return too_few({ 'exhausted' }) end

local free = base .. 'free'
local hold_ms = ttl + grace
local want = attr_json ~= '' and cjson.decode(attr_json) or {}

-- The waiting line (waitMs): reserves that wait for the same filter take the free items in the order they began to
-- wait, first fit. `line` names the filter (the service gives one to no filter, a value prefix alone, or one
-- attribute alone: filters whose free items Redis counts exactly once a try of them has failed at its pick, as a
-- pick that fails removes every stale entry it meets) and is "" for a reserve that does not wait: like a fair
-- semaphore's tryAcquire, that takes what is free. <base>wq:<line> orders the members "<count> <rid>" by a number
-- drawn when each joined (<base>wn:<line>); <base>wl:<line> gives each the time its place lapses unless a try keeps
-- it (a waiter tries at least every 375 ms; one whose instance died or stalled is passed over from `place_ms` after
-- its last try, and one that comes back after that joins at the end). A try counts out of the free items, in order,
-- each live waiter ahead of it (at most AHEAD) that they could serve now; what is left must be `count` or more. A
-- waiter that is served leaves the line here; one that gives up leaves it by HoldStore.leaveLine, or is passed over
-- once its place lapses. ahead_live: how many live waiters are ahead of this one (of the AHEAD first), reported with
-- "exhausted": the first in line (0) tries again sooner than the others (ReservationsService); with it, how many of
-- the matching free items the live waiters ahead leave (`spare`): the service wakes its waiters behind this one that
-- they could serve (a free wakes the first of a line whatever its count, and those behind only if what came free
-- alone serves them).
local queue, places, member, ahead_live
if line ~= '' then
  local AHEAD = 64
  local numbers = base .. 'wn:' .. line
  queue, places, member = base .. 'wq:' .. line, base .. 'wl:' .. line, count .. ' ' .. rid
  local place, rank = redis.call('ZSCORE', places, member), redis.call('ZRANK', queue, member)
  if not rank or not place or tonumber(place) <= now then
    redis.call('ZADD', queue, redis.call('INCR', numbers), member)
    rank = redis.call('ZRANK', queue, member)
  end
  redis.call('ZADD', places, now + place_ms, member)
  redis.call('PEXPIRE', queue, place_ms)
  redis.call('PEXPIRE', places, place_ms)
  redis.call('PEXPIRE', numbers, place_ms)
  local live = {}
  if rank > 0 then
    local ahead = redis.call('ZRANGE', queue, 0, math.min(rank, AHEAD) - 1)
    local lapses = redis.call('ZMSCORE', places, unpack(ahead))
    local gone = {}
    for i, m in ipairs(ahead) do
      local n = tonumber(string.match(m, '^(%d+) '))
      if n and lapses[i] and tonumber(lapses[i]) > now then
        live[#live + 1] = n
      else
        gone[#gone + 1] = m
      end
    end
    if #gone > 0 then
      redis.call('ZREM', queue, unpack(gone))
      redis.call('ZREM', places, unpack(gone))
    end
  end
  ahead_live = tostring(#live)
  -- What the pick below could find at most (index entries, stale ones included): too few, and it need not look.
  local left
  if attr_json ~= '' then
    local k, v = next(want)
    left = redis.call('ZCARD', attr_key(base, k, v))
  elseif prefix ~= '' then
    left = redis.call('ZLEXCOUNT', free, '[' .. prefix, '(' .. prefix .. '\255')
  else
    left = redis.call('ZCARD', free)
  end
  local spare, kept = left, 0
  for _, n in ipairs(live) do
    if n <= spare then
      spare = spare - n
      kept = kept + 1
    end
  end
  if left < count then return too_few({ 'exhausted', 'line', ahead_live, tostring(spare) }) end
  if spare < count then return too_few({ 'exhausted', 'waiters', tostring(kept), ahead_live, tostring(spare) }) end
end

local chosen, seen = {}, {}
-- Items consider() found behind a wrong entry, to index under their own entry once a walk by rank is over (an
-- entry added meanwhile would move the ranks of the members after it); nil: index them at once.
local reindex_later = nil
-- True when a filtered walk stopped before it had read every candidate (MAX_LOOKUPS).
local limited = false

-- True when the item's value starts with the filter's prefix and it has every attribute pair the filter names.
local function matches(item)
  if prefix ~= '' and string.sub(item.v, 1, #prefix) ~= prefix then return false end
  for k, v in pairs(want) do
    if type(item.a) ~= 'table' or item.a[k] ~= v then return false end
  end
  return true
end

-- Drops an entry with no free, matching item behind it from the free index and from the index it was found
-- in, `source`: {key, rem}, an attribute's ZSET (rem "ZREM") or a task group's SET (rem "SREM"), or nil.
local function drop(m, source)
  redis.call('ZREM', free, m)
  if source then redis.call(source.rem, source.key, m) end
end

-- Holds a candidate member and takes it out of the free index if it is still free, unheld and what the filter
-- asks for (the hold's SET NX is the check for "unheld"); repairs the index if not.
local function consider(m, source)
  if #chosen >= count then return end
  if seen[m] then
    -- Considered before and still listed where it was found. Every entry considered leaves the index, or the
    -- indexes that list it wrongly, so this is only a safety net: drop it, so that the picking loops always end.
    drop(m, source)
    return
  end
  seen[m] = true
  local id = id_of(m)
  local json = item_get(base, id)
  local item = decode_item(json)
  if json and not item then
    -- A cache entry that is not an item: forget it with the index entry; the rebuild re-adds the item from Postgres.
    item_del(base, id)
    drop(m, source)
    return
  end
  local own = item and member_of(item) == m
  if item and not own then
    -- An entry naming another value than its item's: drop it, and index the item under its own entry if it
    -- is unheld (a later pick may find it there, unless it is a walk by rank).
    drop(m, source)
    if redis.call('EXISTS', base .. 'h:' .. id) == 0 then
      if reindex_later then
        reindex_later[#reindex_later + 1] = item
      else
        index(base, item)
      end
    end
    return
  end
  if own and not matches(item) then
    -- Listed in an attribute index whose pair the item does not have: drop it from the indexes that are wrong.
    for k, v in pairs(want) do
      if type(item.a) ~= 'table' or item.a[k] ~= v then redis.call('ZREM', attr_key(base, k, v), m) end
    end
    return
  end
  if not item or not redis.call('SET', base .. 'h:' .. id, rid, 'PX', hold_ms, 'NX') then
    -- An index entry without a free, unheld item behind it: drop it.
    drop(m, source)
    return
  end
  unindex(base, item, m)
  chosen[#chosen + 1] = { json = json, item = item }
end

-- The free index and each attribute's index sort their members by value, so the members with a value prefix
-- form one lex range of each. UTF-8 never holds byte 0xFF.
local from, to = '-', '+'
if prefix ~= '' then from, to = '[' .. prefix, '(' .. prefix .. '\255' end

if attr_json ~= '' then
  local sources = {}
  for k, v in pairs(want) do sources[#sources + 1] = { key = attr_key(base, k, v), rem = 'ZREM' } end
  if #sources == 1 and prefix == '' then
    -- Random picks; stale entries are removed as they are met, so this converges.
    while #chosen < count do
      local picks = redis.call('ZRANDMEMBER', sources[1].key, count - #chosen)
      if #picks == 0 then break end
      for _, m in ipairs(picks) do consider(m, sources[1]) end
    end
  else
    -- Several attributes, or an attribute and a prefix. The candidates are the prefix's range (every member, with
    -- no prefix) of the attribute index that has the fewest members in it. They are read a window of WINDOW
    -- consecutive members at a time (every score is 0, so ranks follow values), the windows in random order and
    -- none twice, and the other attributes are checked a window at a time (ZMSCORE), until `count` are held or
    -- every window was read. Values cluster by attribute (the numbers of one city share prefixes), so reading in
    -- value order could cross long runs of non-matching members before the first match. Once PROBES windows did
    -- not find enough, Redis counts what is left of the attributes' intersection (in C, stopping at
    -- INTERSECTION_READ; the prefix is not counted there): too few is an answer at once, and a small intersection
    -- is read whole (with a prefix, its members that have it). No call copies a whole index. A walk that has
    -- looked up MAX_LOOKUPS members in the indexes (a window's members in each attribute's) without finding
    -- enough stops, and the answer says so ("limited"): Redis serves nothing else meanwhile, and a pool of
    -- millions with a filter that matches rarely would hold it for seconds.
    local WINDOW, PROBES, INTERSECTION_READ, MAX_LOOKUPS = 64, 4, 256, 32768
    local max_windows = math.max(PROBES + 1, math.floor(MAX_LOOKUPS / (WINDOW * #sources)))
    local walk, size = 1, nil
    for i, source in ipairs(sources) do
      local n = redis.call('ZLEXCOUNT', source.key, from, to)
      if not size or n < size then walk, size = i, n end
    end
    local key = sources[walk].key

    -- Considers the candidates that have the prefix; true if it considered any.
    local function consider_all(candidates)
      local considered = false
      for _, m in ipairs(candidates) do
        if #chosen >= count then break end
        if string.sub(m, 1, #prefix) == prefix then
          consider(m, sources[walk])
          considered = true
        end
      end
      return considered
    end

    -- Considers the members of a window that every other attribute index lists and that have the prefix.
    local function consider_listed(members)
      local candidates = members
      for i, source in ipairs(sources) do
        if i ~= walk and #candidates > 0 then
          local scores = redis.call('ZMSCORE', source.key, unpack(candidates))
          local listed = {}
          for n, m in ipairs(candidates) do
            if scores[n] then listed[#listed + 1] = m end
          end
          candidates = listed
        end
      end
      return consider_all(candidates)
    end

    -- Fewer candidates than wanted (stale ones included): fewer match.
    local windows = size >= count and math.ceil(size / WINDOW) or 0
    local first = (windows == 0 or prefix == '') and 0 or redis.call('ZLEXCOUNT', key, '-', '(' .. prefix)
    math.randomseed(tonumber(string.sub(rid, -8), 16) or now)
    -- The windows' order is a Fisher-Yates shuffle done as it goes: slot j holds order[j], or j itself.
    local order, read = {}, 0
    reindex_later = {}
    -- {rank, n}: a window read at that rank lost n members (taken or dropped), so later ones start n lower.
    local shifts = {}
    while #chosen < count and read < windows do
      if read == max_windows then
        limited = true
        break
      end
      if read == PROBES then
        -- (unpack expands only as the last argument)
        local card, inter = { 'ZINTERCARD', #sources }, { 'ZINTER', #sources }
        for _, source in ipairs(sources) do
          card[#card + 1], inter[#inter + 1] = source.key, source.key
        end
        card[#card + 1], card[#card + 2] = 'LIMIT', INTERSECTION_READ
        local left = redis.call(unpack(card))
        if left < INTERSECTION_READ then
          -- (consider_all passes over the members without the prefix)
          if left >= count - #chosen then consider_all(redis.call(unpack(inter))) end
          break
        end
      end
      local j = math.random(read + 1, windows)
      local w = order[j] or j
      order[j] = order[read + 1] or (read + 1)
      read = read + 1
      local nominal = first + (w - 1) * WINDOW
      local start = nominal
      for _, shift in ipairs(shifts) do
        if shift[1] < nominal then start = start - shift[2] end
      end
      local members = redis.call('ZRANGE', key, start, start + WINDOW - 1)
      if consider_listed(members) and #chosen < count then
        local still, lost = redis.call('ZMSCORE', key, unpack(members)), 0
        for n = 1, #members do
          if not still[n] then lost = lost + 1 end
        end
        if lost > 0 then shifts[#shifts + 1] = { nominal, lost } end
      end
    end
    -- Not one this walk has taken since, under its own entry: it is held now (by this reservation).
    local unheld = {}
    for _, item in ipairs(reindex_later) do
      if redis.call('EXISTS', base .. 'h:' .. item.id) == 0 then unheld[#unheld + 1] = item end
    end
    index_all(base, unheld)
    reindex_later = nil
  end
elseif prefix ~= '' then
  -- Every member considered leaves the index, so the next page starts at offset 0 again.
  while #chosen < count do
    local page = redis.call('ZRANGEBYLEX', free, from, to, 'LIMIT', 0, count - #chosen)
    if #page == 0 then break end
    for _, m in ipairs(page) do consider(m) end
  end
else
  if affinity then
    -- A reviewer gets a task from a group it already leases in before any other group (not one whose leases of it
    -- have all lapsed, see lapsed).
    local leased = redis.call('HGETALL', base .. 'og:' .. owner)
    local groups, stale = {}, {}
    if #leased > 0 then stale = select(2, lapsed()) end
    for i = 1, #leased, 2 do
      if tonumber(leased[i + 1]) > (stale[leased[i]] or 0) then groups[#groups + 1] = leased[i] end
    end
    for _, g in ipairs(groups) do
      if #chosen >= count then break end
      local group = { key = base .. 'fg:' .. g, rem = 'SREM' }
      for _, m in ipairs(redis.call('SRANDMEMBER', group.key, count)) do consider(m, group) end
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
  if limited then return { 'exhausted', 'limited' } end
  -- (No spare: the count before the pick included the stale entries it dropped.)
  return too_few(ahead_live and { 'exhausted', 'line', ahead_live } or { 'exhausted' })
end

local rkey = base .. 'r:' .. rid
-- The owner's counters are read by the quota check and by lease affinity alone, and a pool's
-- maxHoldsPerOwner never changes: a reservation of a pool without a quota counts nowhere (no "cnt").
local counted = max_holds > 0 or kind == 'l'
local r = { o = owner, k = kind, s = 'held', i = '[' .. table.concat(jsons, ',') .. ']', c = tostring(now),
  e = tostring(now + ttl), cnt = counted and '1' or nil, g = generation }
if counted then
  redis.call('HSET', rkey, 'o', r.o, 'k', r.k, 's', r.s, 'i', r.i, 'c', r.c, 'e', r.e, 'cnt', r.cnt, 'g', r.g)
  count_items(base, owner, kind, items, 1)
else
  redis.call('HSET', rkey, 'o', r.o, 'k', r.k, 's', r.s, 'i', r.i, 'c', r.c, 'e', r.e, 'g', r.g)
end
if idem_key ~= '' then
  -- The record keeps its key too: a confirm records it in Postgres, from where a rebuild puts it back.
  local idem = idem_key .. '\n' .. body_hash
  redis.call('HSET', rkey, 'ik', idem)
  redis.call('SET', base .. 'idem:' .. idem_key, rid .. '\n' .. body_hash, 'PX', idem_ttl)
end
redis.call('PEXPIRE', rkey, hold_ms + open_record_ms)
redis.call('ZADD', base .. 'exp', now + hold_ms, rid)
if member then
  redis.call('ZREM', queue, member)
  redis.call('ZREM', places, member)
end
return reply_of('ok', rid, r, now)
