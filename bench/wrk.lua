-- Requests for wrk (bench/wrk.ts). Either one fixed request (WRK_METHOD, WRK_PATH, WRK_BODY), or, with
-- WRK_REQUESTS naming a file of "method<TAB>path<TAB>body" lines, each line sent once: thread k of n
-- takes lines k, k+n, ... ; a thread that has used all of its lines sends GET /health/live, counted
-- apart as "ran dry". done() prints one JSON line with the counts by status and the latency percentiles.
local threads = {}
local thread_count = tonumber(os.getenv('WRK_THREADS') or '1')
local next_index = 0

function setup(thread)
  thread:set('index', next_index)
  next_index = next_index + 1
  table.insert(threads, thread)
end

-- Per thread. statuses and dry are globals: done() reads them with thread:get.
local requests = nil
local position = 0
statuses = {}
dry = 0
local fixed = nil
local dry_request = nil

function init(args)
  dry_request = wrk.format('GET', '/health/live')
  local file = os.getenv('WRK_REQUESTS')
  if file == nil or file == '' then
    local headers = { ['content-type'] = 'application/json' }
    fixed = wrk.format(os.getenv('WRK_METHOD') or 'GET', os.getenv('WRK_PATH') or '/', headers, os.getenv('WRK_BODY'))
    return
  end
  requests = {}
  local line_no = 0
  local headers = { ['content-type'] = 'application/json' }
  for line in io.lines(file) do
    if line_no % thread_count == index then
      local method, path, body = line:match('^([^\t]*)\t([^\t]*)\t(.*)$')
      table.insert(requests, wrk.format(method, path, headers, body))
    end
    line_no = line_no + 1
  end
end

function request()
  if fixed then return fixed end
  position = position + 1
  if position > #requests then
    dry = dry + 1
    return dry_request
  end
  return requests[position]
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests_)
  local counts = {}
  local ran_dry = 0
  for _, thread in ipairs(threads) do
    local s = thread:get('statuses')
    for status, n in pairs(s) do counts[tostring(status)] = (counts[tostring(status)] or 0) + n end
    ran_dry = ran_dry + thread:get('dry')
  end
  local parts = {}
  for status, n in pairs(counts) do table.insert(parts, string.format('"%s":%d', status, n)) end
  io.write(string.format(
    'WRK_RESULT {"requests":%d,"durationUs":%d,"errors":%d,"ranDry":%d,"p50Us":%d,"p99Us":%d,"byStatus":{%s}}\n',
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    ran_dry, latency:percentile(50), latency:percentile(99), table.concat(parts, ',')))
end
