import { MigrationInterface, QueryRunner } from 'typeorm';

/**
 * A resource's attributes are a flat object of strings, as the API takes them: the Redis scripts index
 * each pair as `<key>\0<value>`, and a nested, null or boolean value there stops the rebuild of Redis.
 * The path is strict: in lax mode `$.*` would unwrap an array value and pass `{"k": ["x"]}`.
 * Rows written outside the API (a bulk load in SQL, say) are held to it too from now on. Rows already
 * there are checked once; if some break it, the constraint stays NOT VALID (new and updated rows are
 * still checked), the migration warns, and the rebuild leaves those rows out, naming them.
 */
export class AttributesAreStrings1764300000000 implements MigrationInterface {
  name = 'AttributesAreStrings1764300000000';

  async up(q: QueryRunner): Promise<void> {
    await q.query(`
      ALTER TABLE t_resource ADD CONSTRAINT t_resource_attributes_strings
        CHECK (jsonb_typeof(attributes) = 'object' AND NOT jsonb_path_exists(attributes, 'strict $.* ? (@.type() != "string")'))
        NOT VALID`);
    // Checking every row of a large table may take long. (The runner sets no client timeout; pg does not send
    // a statement_timeout of 0, so one set for the role or database would still apply without this.)
    await q.query(`SET LOCAL statement_timeout = 0`);
    await q.query(`
      DO $$
      BEGIN
        ALTER TABLE t_resource VALIDATE CONSTRAINT t_resource_attributes_strings;
      EXCEPTION WHEN check_violation THEN
        RAISE WARNING 'some rows of t_resource have attributes that are not a flat object of strings; '
          'respool leaves them out of Redis until they are fixed';
      END $$`);
  }

  async down(q: QueryRunner): Promise<void> {
    await q.query(`ALTER TABLE t_resource DROP CONSTRAINT t_resource_attributes_strings`);
  }
}
