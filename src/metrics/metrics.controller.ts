import { Controller, Get, Header, Res } from '@nestjs/common';
import { ApiOkResponse, ApiOperation, ApiTags } from '@nestjs/swagger';
import type { FastifyReply } from 'fastify';
import { MetricsService } from './metrics.service.js';

@ApiTags('operations')
@Controller('metrics')
export class MetricsController {
  constructor(private readonly metrics: MetricsService) {}

  @Get()
  @Header('cache-control', 'no-store')
  @ApiOperation({ summary: 'Prometheus metrics of this instance (no auth)' })
  @ApiOkResponse({
    description: 'The metrics in the Prometheus text format (names in the README, "Operations")',
    content: {
      'text/plain': {
        schema: {
          type: 'string',
          description: 'Prometheus text exposition format 0.0.4: respool_* counters, gauges and histograms, and Node process metrics',
        },
      },
    },
  })
  async scrape(@Res() reply: FastifyReply): Promise<void> {
    const { contentType, body } = await this.metrics.render();
    await reply.header('content-type', contentType).send(body);
  }
}
