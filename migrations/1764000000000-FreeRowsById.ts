import { MigrationInterface, QueryRunner } from 'typeorm';

/**
 * (pool_id, state) becomes (pool_id, state, id): the rebuild pages through a pool's free rows in id
 * order, which the old index could only serve by sorting every free row of the pool for each page.
 */
export class FreeRowsById1764000000000 implements MigrationInterface {
  name = 'FreeRowsById1764000000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`CREATE INDEX t_resource_pool_state_id_idx ON t_resource (pool_id, state, id)`);
    await q.query(`DROP INDEX t_resource_pool_state_idx`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`CREATE INDEX t_resource_pool_state_idx ON t_resource (pool_id, state)`);
    await q.query(`DROP INDEX t_resource_pool_state_id_idx`);
  }
}
