import { describe, expect, it } from 'vitest';
import { parseSamples, summariseSamples } from '../../bench/perf-sampler.js';

// `perf script -F comm,pid,tid,ip,sym,dso` as perf writes it: a head line a sample, then its stack, leaf first.
const SCRIPT = `node 100/100
\t     150cdea Builtins_LoadIC (/usr/bin/node)
\t7f47900ef86d JS:*reply file:///srv/node_modules/fastify/lib/reply.js:1:1 (/tmp/perf-100.map)
\t7f47900ef000 JS:*confirm file:///srv/dist/src/reservations/commit.service.js:2:2 (/tmp/perf-100.map)

node 100/104
\t     a1b2c3 v8::internal::Scavenger::ScavengeObject<v8::internal::FullHeapObjectSlot> (/usr/bin/node)
\t     a1b2d4 v8::internal::ScavengerCollector::JobTask::Run (/usr/bin/node)

node 100/100
\tffffffff81aa tcp_sendmsg_locked ([kernel.kallsyms])
\t7f47900ef1 JS:*writevGeneric node:internal/stream_base_commons:123:23 (/tmp/perf-100.map)
\t7f47900ef2 JS:*write file:///srv/node_modules/ioredis/built/Redis.js:3:3 (/tmp/perf-100.map)

node 100/100
\t7f47900ef3 JS:*pin file:///srv/dist/src/redis/hold-store.repository.js:4:4 (/tmp/perf-100.map)

node 200/200
\t     150cdea Builtins_LoadIC (/usr/bin/node)

redis-server 300/300
\t     55aa dictFind (/usr/bin/redis-check-rdb)

swapper     0/0
\tffffffff821f2c2b pv_native_safe_halt ([kernel.kallsyms])
`;

describe('perf samples', () => {
  it('reads each sample with its process and its stack, leaf first, without addresses or files', () => {
    const samples = parseSamples(SCRIPT);
    expect(samples.map((s) => [s.comm, s.pid, s.kernel])).toEqual([
      ['node', 100, false],
      ['node', 100, false],
      ['node', 100, true],
      ['node', 100, false],
      ['node', 200, false],
      ['redis-server', 300, false],
      ['swapper', 0, true],
    ]);
    expect(samples[0].stack).toEqual([
      'Builtins_LoadIC',
      'JS:*reply file:///srv/node_modules/fastify/lib/reply.js:1:1',
      'JS:*confirm file:///srv/dist/src/reservations/commit.service.js:2:2',
    ]);
  });

  it('gives CPU time per operation by process, and the service’s by what ran and by the nearest package', () => {
    // 999 samples a second: with 1 operation, one sample is 1,001 µs.
    const report = summariseSamples(parseSamples(SCRIPT), 100, 200, 1);
    const section = (title: string) =>
      report
        .split('--- ')
        .find((s) => s.startsWith(title))!
        .split('\n')
        .slice(1)
        .filter(Boolean)
        .map((line) => line.trim());
    expect(section('by process')).toEqual(['4004.0 µs  service', '1001.0 µs  load generator', '1001.0 µs  redis', '1001.0 µs  idle']);
    expect(section('the service, by what ran')).toEqual(
      expect.arrayContaining([
        '1001.0 µs  V8 built-ins',
        '1001.0 µs  garbage collection',
        '1001.0 µs  kernel',
        '1001.0 µs  JavaScript (compiled)',
      ]),
    );
    expect(section('the service, by what ran')).toHaveLength(4);
    expect(section('the service, by the package')).toEqual(
      expect.arrayContaining([
        '1001.0 µs  fastify',
        '1001.0 µs  (no JavaScript on the stack)',
        '1001.0 µs  ioredis',
        '1001.0 µs  respool redis/hold-store.repository.js',
      ]),
    );
    expect(section('the service, by the package')).toHaveLength(4);
  });
});
