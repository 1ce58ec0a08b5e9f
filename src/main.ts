import 'reflect-metadata';
import { ConfigError, loadConfig } from './config/app-config.js';
import { EvictionPolicyError } from './redis/redis.client.js';
import { createApp } from './app.factory.js';

async function main(): Promise<void> {
  const config = loadConfig(process.env);
  const app = await createApp(config);
  await app.listen({ port: config.PORT, host: config.HOST });
  console.log(JSON.stringify({ level: 30, msg: `respool listening on http://${config.HOST}:${config.PORT} (docs at /docs)` }));
}

main().catch((err: unknown) => {
  if (err instanceof ConfigError || err instanceof EvictionPolicyError) {
    console.error(`respool cannot start: ${err.message}`);
  } else {
    console.error('respool cannot start:', err);
  }
  process.exit(1);
});
