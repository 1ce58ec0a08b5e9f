import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ResourceRepository } from '../../src/database/resource.repository.js';
import { TestWorld, numbers, seedPool } from '../support/harness.js';

/**
 * `respool_allocate`, called as the commit batcher calls it, with batches built by hand: a batch whose
 * commits all land goes all at once; a batch with any failing commit is rolled back and run one by one.
 * Either way every commit must get its own answer and leave exactly its own rows.
 */
describe('respool_allocate: a batch of commits', () => {
  const world = new TestWorld('allocate');
  let poolId: string;
  let generation: number;
  let ids: string[];
  let repository: ResourceRepository;

  interface Commit {
    rid: string;
    epoch?: number;
    generation?: number;
    items: { id: string; version: number }[];
  }

  beforeAll(async () => {
    const api = await world.start();
    repository = api.app.get(ResourceRepository);
    await seedPool(api, 'alloc', numbers(40));
    [{ id: poolId }] = await world.query(`SELECT id::text AS id FROM t_pool WHERE name = 'alloc'`);
    [{ gen: generation }] = await world.query(`SELECT gen::int AS gen FROM t_redis_generation`);
    ids = (await world.query(`SELECT id::text AS id FROM t_resource WHERE pool_id = $1 ORDER BY id`, [poolId])).map((r) => r.id);
  });
  afterAll(() => world.cleanup());

  const rid = (name: string) => `alloc.${name}`;

  /** One call of the function for this batch, in this order, as the commit batcher makes it. */
  const allocate = (batch: Commit[]): Promise<string[]> =>
    repository.callAllocate(
      batch.map((c) => ({
        poolId,
        owner: `owner-of-${c.rid}`,
        reservationId: c.rid,
        epoch: c.epoch ?? 1,
        generation: c.generation ?? generation,
        items: c.items,
        body: JSON.stringify({ rid: c.rid }),
      })),
    );

  const items = (id: string) => world.query(`SELECT state, version, owner FROM t_resource WHERE id = $1`, [id]).then((r) => r[0]);
  const history = (reservation: string) =>
    world.query(`SELECT resource_id::text AS id, version, owner FROM t_allocation_history WHERE reservation_id = $1 ORDER BY resource_id`, [
      reservation,
    ]);
  const commitRow = (reservation: string) =>
    world.query(`SELECT resource_ids::text[] AS ids, body FROM t_commit WHERE reservation_id = $1`, [reservation]).then((r) => r[0]);
  const decisions = (reservation: string) =>
    world.query(`SELECT epoch, decision FROM t_commit_decision WHERE reservation_id = $1 ORDER BY epoch`, [reservation]);

  /** What a commit that landed leaves: its items allocated to its owner at version + 1, a history row each, its records. */
  async function expectLanded(c: Commit) {
    const owner = `owner-of-${c.rid}`;
    for (const i of c.items) expect(await items(i.id)).toEqual({ state: 2, version: i.version + 1, owner });
    expect(await history(c.rid)).toEqual(
      // In id order, as the query gives them: ids are numbers.
      c.items.map((i) => ({ id: i.id, version: i.version + 1, owner })).sort((a, b) => Number(a.id) - Number(b.id)),
    );
    expect(await commitRow(c.rid)).toEqual({ ids: c.items.map((i) => i.id), body: { rid: c.rid } });
    expect(await decisions(c.rid)).toContainEqual({ epoch: c.epoch ?? 1, decision: 'commit' });
  }

  it('every commit lands: each item allocated once, with its history row, decision and commit record', async () => {
    const batch: Commit[] = [
      { rid: rid('a'), items: [{ id: ids[0], version: 0 }] },
      {
        rid: rid('b'),
        items: [
          { id: ids[1], version: 0 },
          { id: ids[2], version: 0 },
        ],
      },
      { rid: rid('c'), epoch: 3, items: [{ id: ids[3], version: 0 }] },
    ];
    expect(await allocate(batch)).toEqual(['committed', 'committed', 'committed']);
    for (const c of batch) await expectLanded(c);
    expect(await items(ids[4])).toEqual({ state: 1, version: 0, owner: null });
  });

  // Each kind of failure in a batch of its own, between two commits that must land: the batch as a whole
  // fails, and the commits then run one by one.
  let next = 10;
  const free = () => ({ id: ids[next++], version: 0 });
  /** Items a case had allocated by another commit first. */
  const takenFirst = new Set<string>();
  const cases: { kind: string; answer: string; failing: () => Promise<Commit> }[] = [
    {
      kind: 'a version that moved on',
      answer: 'conflict',
      failing: async () => ({ rid: rid('stale-version'), items: [{ ...free(), version: 7 }] }),
    },
    {
      kind: 'a Redis generation no longer current',
      answer: 'conflict',
      failing: async () => ({ rid: rid('old-generation'), generation: generation - 1, items: [free()] }),
    },
    {
      kind: 'two items, the second already allocated (the first must not stay allocated either)',
      answer: 'conflict',
      failing: async () => {
        const taken = free();
        expect(await allocate([{ rid: rid('half-taker'), items: [taken] }])).toEqual(['committed']);
        takenFirst.add(taken.id);
        return { rid: rid('half'), items: [free(), taken] };
      },
    },
    {
      kind: 'an epoch already ended',
      answer: 'decided',
      failing: async () => {
        await world.query(`INSERT INTO t_commit_decision (reservation_id, epoch, decision) VALUES ($1, 1, 'abort')`, [rid('decided')]);
        return { rid: rid('decided'), items: [free()] };
      },
    },
    {
      kind: 'a reservation committed before',
      answer: 'duplicate',
      failing: async () => {
        await world.query(`INSERT INTO t_commit (reservation_id, pool_id, owner, resource_ids, body) VALUES ($1, $2, 'x', '{}', '{}')`, [
          rid('duplicate'),
          poolId,
        ]);
        return { rid: rid('duplicate'), epoch: 2, items: [free()] };
      },
    },
  ];

  it.each(cases)('$kind fails alone: the commits around it land, and nothing of it stays', async ({ failing, answer }) => {
    const before: Commit = { rid: rid(`before-${next}`), items: [free()] };
    const bad = await failing();
    const after: Commit = { rid: rid(`after-${next}`), items: [free(), free()] };
    expect(await allocate([before, bad, after])).toEqual(['committed', answer, 'committed']);
    await expectLanded(before);
    await expectLanded(after);
    expect(await history(bad.rid)).toEqual([]);
    if (answer !== 'duplicate') expect(await commitRow(bad.rid)).toBeUndefined();
    expect((await decisions(bad.rid)).filter((d) => d.decision === 'commit')).toEqual([]);
    for (const i of bad.items.filter((i) => !takenFirst.has(i.id)))
      expect(await items(i.id)).toEqual({ state: 1, version: 0, owner: null });
  });

  it('an item that an earlier commit of the same batch allocates: that one lands, this one conflicts', async () => {
    const first: Commit = { rid: rid('first'), items: [free()] };
    const again: Commit = { rid: rid('again'), items: [first.items[0]] };
    expect(await allocate([first, again])).toEqual(['committed', 'conflict']);
    await expectLanded(first);
    expect(await history(again.rid)).toEqual([]);
    expect(await commitRow(again.rid)).toBeUndefined();
  });

  it('the same commit twice in one batch (a confirm retried on another instance): the first lands, the second finds its epoch ended', async () => {
    const twice: Commit = { rid: rid('twice'), epoch: 2, items: [free()] };
    expect(await allocate([twice, twice])).toEqual(['committed', 'decided']);
    await expectLanded(twice);
    expect(await history(twice.rid)).toHaveLength(1);
  });
});
